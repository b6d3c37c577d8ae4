"""What loading a model folder says: nothing where all is as expected (a critic's value head on a causal LM's
folder is expected to be new), and plainly, without terminal codes, which weights are new or unused otherwise."""

import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from fsdptrain.config.shared import ModelConfig
from fsdptrain.models.loading import load_pretrained

MODEL = ModelConfig(trust_remote_code=False, enable_gradient_checkpointing=False, attn_implementation="auto")


def test_a_critic_loads_quietly_and_a_surprise_is_said_plainly(tiny_llama, capfd, caplog):
    config = AutoConfig.from_pretrained(tiny_llama, num_labels=1)
    with caplog.at_level(logging.WARNING, logger="fsdptrain"):
        load_pretrained(tiny_llama, MODEL, config, torch.float32, AutoModelForTokenClassification, None, 0, None)
        assert not caplog.records
        deeper = AutoConfig.from_pretrained(tiny_llama, num_hidden_layers=3)
        load_pretrained(tiny_llama, MODEL, deeper, torch.float32, AutoModelForCausalLM, None, 0, None)
    printed = capfd.readouterr()
    assert "LOAD REPORT" not in printed.out + printed.err and "\x1b[" not in printed.out + printed.err
    (warning,) = caplog.records
    assert "9 weight(s) the folder lacks, initialized at random (model.layers.2." in warning.getMessage()
