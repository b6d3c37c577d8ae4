"""The `huggingface/` folder of a checkpoint: config, tokenizer (a vision-language model's image processor too) and
safetensors weights that transformers and vLLM load as they load any Hugging Face model."""

import os
import shutil

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from fsdptrain.dtypes import DTYPES
from fsdptrain.models.vision import model_class

# Config fields that must agree for a checkpoint's weights to fit a model.
ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
# a vision-language model's processor settings, copied from the pretrained folder as they are
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json", "chat_template.json",
                   "chat_template.jinja")


def save_hf_folder(
    out: str,
    config: PretrainedConfig,
    generation_config: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase,
    state: dict[str, torch.Tensor] | None,
    dtype: str,
    pretrained: str | None = None,
) -> None:
    """Write config and tokenizer (with the `pretrained` folder's processor files), plus the weights in `dtype` when
    a full `state` is given.

    The weights go through transformers' own `save_pretrained`, which writes the standard safetensors layout,
    drops tied duplicates and shards large models with an index.
    """
    os.makedirs(out, exist_ok=True)
    tokenizer.save_pretrained(out)
    generation_config.save_pretrained(out)
    for name in PROCESSOR_FILES:
        if pretrained is not None and os.path.isfile(os.path.join(pretrained, name)) and not os.path.isfile(os.path.join(out, name)):
            shutil.copyfile(os.path.join(pretrained, name), os.path.join(out, name))
    if state is None:
        config.save_pretrained(out)
        return
    with torch.device("meta"):
        model = model_class(config, AutoModelForCausalLM).from_config(config)
    loaded = model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()  # a tied output layer may be absent from `state`: it is the input embedding
    unfilled = [name for name, t in model.state_dict().items() if t.is_meta]  # parameters and persistent buffers
    if unfilled or loaded.unexpected_keys:
        raise ValueError(f"weights do not fit {config.model_type}: missing {unfilled}, unexpected {loaded.unexpected_keys}")
    model.to(DTYPES[dtype])
    model.generation_config = generation_config
    model.save_pretrained(out)
