"""Typed schema of the trainer configs and their validation.

Defaults live in the YAML files beside this one; the dataclasses here only fix names and types, so a key
missing from the YAML, an unknown key or a value of the wrong type fails with its full dotted name.
"""

import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""


@dataclass
class MultiturnConfig:
    enable: bool
    messages_key: str
    tools_key: str


@dataclass
class DataConfig:
    train_files: Any  # a path or a list of paths
    val_files: Any
    prompt_key: str
    response_key: str
    multiturn: MultiturnConfig
    max_length: int
    truncation: str
    train_batch_size: int
    micro_batch_size_per_gpu: int
    balance_dp_token: bool
    use_dynamic_bsz: bool
    max_token_len_per_gpu: int | None
    shuffle: bool


@dataclass
class MixedPrecisionConfig:
    param_dtype: str | None
    reduce_dtype: str


@dataclass
class FSDPConfig:
    model_dtype: str
    mixed_precision: MixedPrecisionConfig
    cpu_offload: bool
    reshard_after_forward: bool


@dataclass
class ModelConfig:
    partial_pretrain: str
    trust_remote_code: bool
    enable_gradient_checkpointing: bool
    strategy: str
    attn_implementation: str
    chunked_loss_tokens: int
    fsdp_config: FSDPConfig


@dataclass
class OptimConfig:
    lr: float
    betas: list[float]
    weight_decay: float
    clip_grad: float
    lr_warmup_steps_ratio: float
    lr_warmup_steps: int | None
    lr_scheduler: str
    min_lr_ratio: float
    wsd_decay_ratio: float


@dataclass
class CheckpointConfig:
    save_contents: list[str]
    load_contents: list[str] | None
    hf_dtype: str | None


@dataclass
class TrainerConfig:
    default_local_dir: str
    project_name: str
    experiment_name: str
    total_epochs: int
    total_training_steps: int | None
    test_freq: int
    save_freq: int
    max_ckpt_to_keep: int | None
    resume_mode: str
    resume_from_path: str | None
    checkpoint: CheckpointConfig
    logger: list[str]
    seed: int
    device: str
    profile_step: int | None
    keep_freed_host_memory: bool


@dataclass
class SFTConfig:
    data: DataConfig
    model: ModelConfig
    optim: OptimConfig
    trainer: TrainerConfig
    use_remove_padding: bool
    ulysses_sequence_parallel_size: int


DTYPES = ("fp32", "bf16")
LOGGERS = ("console", "file", "wandb", "tensorboard")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {'|'.join(map(str, allowed))}, got {value!r}")


def _positive(key: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")


def _as_path_list(key: str, value: Any) -> list[str]:
    paths = [value] if isinstance(value, str) else list(value or [])
    if not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(f"{key} must be a path or a list of paths, got {value!r}")
    return paths


def sft_defaults() -> DictConfig:
    """The defaults of sft_trainer.yaml, for building a config (or one of its sections) outside Hydra."""
    return OmegaConf.load(os.path.join(os.path.dirname(__file__), "sft_trainer.yaml"))


def to_typed(cfg: DictConfig, schema: type) -> Any:
    """Merge a Hydra config onto `schema` and return the dataclass instance; errors name the key."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(f"{key}: {getattr(e, 'msg', str(e)).splitlines()[0]}") from None


def validate_model(model: ModelConfig) -> None:
    if not model.partial_pretrain:
        raise ConfigError("model.partial_pretrain is required: a local Hugging Face model folder")
    if model.strategy != "fsdp2":
        raise ConfigError(f"model.strategy must be fsdp2 (the only strategy fsdptrain implements), got {model.strategy!r}")
    _one_of("model.attn_implementation", model.attn_implementation, ("auto", "sdpa", "eager", "flash_attention_2"))
    if model.chunked_loss_tokens < 0:
        raise ConfigError(f"model.chunked_loss_tokens must be >= 0 (0: full logits), got {model.chunked_loss_tokens}")
    _one_of("model.fsdp_config.model_dtype", model.fsdp_config.model_dtype, DTYPES)
    mp = model.fsdp_config.mixed_precision
    _one_of("model.fsdp_config.mixed_precision.param_dtype", mp.param_dtype, DTYPES + (None,))
    _one_of("model.fsdp_config.mixed_precision.reduce_dtype", mp.reduce_dtype, DTYPES)


def validate_optim(optim: OptimConfig) -> None:
    _positive("optim.lr", optim.lr)
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {optim.betas!r}")
    if optim.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay must be >= 0, got {optim.weight_decay!r}")
    _positive("optim.clip_grad", optim.clip_grad)
    if not 0 <= optim.lr_warmup_steps_ratio <= 1:
        raise ConfigError(f"optim.lr_warmup_steps_ratio must be in [0, 1], got {optim.lr_warmup_steps_ratio!r}")
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps < 0:
        raise ConfigError(f"optim.lr_warmup_steps must be >= 0, got {optim.lr_warmup_steps!r}")
    _one_of("optim.lr_scheduler", optim.lr_scheduler, ("cosine", "wsd", "constant"))
    if not 0 <= optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio!r}")
    if not 0 < optim.wsd_decay_ratio <= 1:
        raise ConfigError(f"optim.wsd_decay_ratio must be in (0, 1], got {optim.wsd_decay_ratio!r}")


def validate_trainer(trainer: TrainerConfig) -> None:
    _positive("trainer.total_epochs", trainer.total_epochs)
    _positive("trainer.total_training_steps", trainer.total_training_steps, allow_none=True)
    _positive("trainer.max_ckpt_to_keep", trainer.max_ckpt_to_keep, allow_none=True)
    for key, value in (("trainer.test_freq", trainer.test_freq), ("trainer.save_freq", trainer.save_freq)):
        if value == 0 or value < -1:
            raise ConfigError(f"{key} must be -1 (never) or > 0, got {value!r}")
    _one_of("trainer.resume_mode", trainer.resume_mode, ("auto", "disable", "resume_path"))
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ConfigError("trainer.resume_from_path is required when trainer.resume_mode=resume_path")
    for key, contents in (
        ("trainer.checkpoint.save_contents", trainer.checkpoint.save_contents),
        ("trainer.checkpoint.load_contents", trainer.checkpoint.load_contents or []),
    ):
        for item in contents:
            _one_of(key, item, CHECKPOINT_CONTENTS)
    _one_of("trainer.checkpoint.hf_dtype", trainer.checkpoint.hf_dtype, DTYPES + (None,))
    for name in trainer.logger:
        _one_of("trainer.logger", name, LOGGERS)
    _one_of("trainer.device", trainer.device, ("auto", "cpu", "cuda"))
    _positive("trainer.profile_step", trainer.profile_step, allow_none=True)


def validate_data(data: DataConfig) -> None:
    data.train_files = _as_path_list("data.train_files", data.train_files)
    if not data.train_files:
        raise ConfigError("data.train_files is required")
    data.val_files = _as_path_list("data.val_files", data.val_files)
    _positive("data.max_length", data.max_length)
    _one_of("data.truncation", data.truncation, ("error", "left", "right"))
    _positive("data.train_batch_size", data.train_batch_size)
    _positive("data.micro_batch_size_per_gpu", data.micro_batch_size_per_gpu)
    if data.use_dynamic_bsz:
        if data.max_token_len_per_gpu is None:
            raise ConfigError("data.max_token_len_per_gpu is required when data.use_dynamic_bsz=true")
        if data.max_token_len_per_gpu < data.max_length:
            raise ConfigError(
                f"data.max_token_len_per_gpu ({data.max_token_len_per_gpu}) must be >= data.max_length "
                f"({data.max_length}) so that every sample fits one micro-batch"
            )


def load_sft_config(cfg: DictConfig) -> SFTConfig:
    """Type-check and validate an SFT config; every error names its key."""
    config: SFTConfig = to_typed(cfg, SFTConfig)
    validate_data(config.data)
    validate_model(config.model)
    validate_optim(config.optim)
    validate_trainer(config.trainer)
    _positive("ulysses_sequence_parallel_size", config.ulysses_sequence_parallel_size)
    if config.ulysses_sequence_parallel_size > 1 and not config.use_remove_padding:
        raise ConfigError("ulysses_sequence_parallel_size > 1 needs use_remove_padding=true (it splits packed rows)")
    return config


def check_batch_layout(data: DataConfig, dp_size: int) -> None:
    """Sizes that depend on the number of data-parallel ranks, checked once the world is known."""
    if data.train_batch_size % dp_size:
        raise ConfigError(
            f"data.train_batch_size ({data.train_batch_size}) must be divisible by the data-parallel size ({dp_size})"
        )
    per_rank = data.train_batch_size // dp_size
    if not data.use_dynamic_bsz and per_rank % data.micro_batch_size_per_gpu:
        raise ConfigError(
            f"data.train_batch_size / dp = {data.train_batch_size} / {dp_size} = {per_rank} samples per rank "
            f"must be divisible by data.micro_batch_size_per_gpu ({data.micro_batch_size_per_gpu})"
        )
