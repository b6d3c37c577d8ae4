"""Hydra overrides reach the typed config; bad keys, types and combinations fail naming the key."""

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from fsdptrain.config.schema import ConfigError, check_batch_layout, load_sft_config

from conftest import torchrun

REQUIRED = ["data.train_files=train.parquet", "model.partial_pretrain=/models/x"]


def config(*overrides):
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        return load_sft_config(compose(config_name="sft_trainer", overrides=[*REQUIRED, *overrides]))


def test_defaults_and_nested_override():
    cfg = config("model.fsdp_config.mixed_precision.reduce_dtype=bf16", "data.multiturn.enable=true", "optim.betas=[0.8,0.9]")
    assert cfg.model.fsdp_config.mixed_precision.reduce_dtype == "bf16"
    assert cfg.data.multiturn.enable is True and cfg.optim.betas == [0.8, 0.9]
    assert cfg.data.max_length == 1024 and cfg.data.truncation == "error" and cfg.model.strategy == "fsdp2"
    assert cfg.data.train_files == ["train.parquet"] and cfg.data.val_files == []
    assert cfg.trainer.default_local_dir == "checkpoints/fsdptrain/sft"


def test_unknown_key_is_named():
    with pytest.raises(ConfigCompositionException, match="data.not_a_key"):
        config("data.not_a_key=1")


def test_unknown_key_from_the_command_line(tmp_path):
    result = torchrun(1, "fsdptrain.sft_trainer", [*REQUIRED, "model.fsdp_config.no_such_thing=1"], check=False)
    assert result.returncode != 0
    assert "model.fsdp_config.no_such_thing" in result.stderr + result.stdout


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.max_length=long", "data.max_length"),
        ("data.truncation=middle", "data.truncation must be one of error|left|right, got 'middle'"),
        ("model.strategy=fsdp", "model.strategy must be fsdp2"),
        ("model.fsdp_config.model_dtype=fp16", "model.fsdp_config.model_dtype must be one of fp32|bf16"),
        ("optim.lr_scheduler=linear", "optim.lr_scheduler must be one of cosine|wsd|constant"),
        ("optim.lr=0", "optim.lr must be > 0"),
        ("trainer.logger=[console,mlflow]", "trainer.logger must be one of console|file|wandb|tensorboard, got 'mlflow'"),
        ("data.use_dynamic_bsz=true", "data.max_token_len_per_gpu is required when data.use_dynamic_bsz=true"),
        ("trainer.resume_mode=resume_path", "trainer.resume_from_path is required"),
        ("trainer.profile_step=0", "trainer.profile_step must be > 0"),
        ("trainer.checkpoint.save_contents=[model,weights]", "trainer.checkpoint.save_contents must be one of"),
        ("trainer.save_freq=0", "trainer.save_freq must be -1"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|").replace("[", r"\[")):
        config(override)


def test_batch_sizes_that_do_not_divide_are_rejected_with_their_numbers():
    cfg = config("data.train_batch_size=10", "data.micro_batch_size_per_gpu=2", "data.use_dynamic_bsz=false")
    layout = lambda dp: check_batch_layout(cfg.data.train_batch_size, "data.train_batch_size", cfg.micro_batching, dp)  # noqa: E731
    with pytest.raises(ConfigError, match=r"data.train_batch_size \(10\) must be divisible by the data-parallel size \(4\)"):
        layout(4)
    with pytest.raises(ConfigError, match=r"10 / 2 = 5 samples per rank must be divisible by data.micro_batch_size_per_gpu \(2\)"):
        layout(2)
    layout(5)


@pytest.mark.parametrize(
    "overrides, dynamic, max_tokens",
    [
        ((), True, 4 * 1024),  # the default: a token budget worth micro_batch_size_per_gpu samples of max_length
        (("data.micro_batch_size_per_gpu=2", "data.max_length=512"), True, 1024),
        (("data.balance_dp_token=false",), False, None),  # verl's per-micro-batch means: cut by count, as verl does
        (("use_remove_padding=false",), False, None),  # padded batches: by count
        (("data.use_dynamic_bsz=false",), False, None),  # set explicitly: verl's meaning
        (("data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=9000"), True, 9000),
        (("data.max_token_len_per_gpu=5000",), True, 5000),
    ],
)
def test_micro_batches_are_cut_by_tokens_where_the_loss_allows(overrides, dynamic, max_tokens):
    batching = config(*overrides).micro_batching
    assert (batching.dynamic, batching.max_tokens) == (dynamic, max_tokens)
