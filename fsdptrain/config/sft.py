"""The SFT trainer's config (verl's sft_trainer.yaml names) and its validation."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig

from fsdptrain.config.base import check_all, positive, to_typed
from fsdptrain.config.shared import (
    FSDPConfig,
    LanguageModelConfig,
    OptimConfig,
    TrainerConfig,
    check_adapter_export,
    validate_data_files,
    validate_fsdp,
    validate_model,
    validate_optim,
    validate_sequence_parallel,
    validate_trainer,
)
from fsdptrain.errors import ConfigError


@dataclass
class MultiturnConfig:
    enable: bool
    messages_key: str
    tools_key: str
    split_turns: bool


@dataclass
class DataConfig:
    train_files: Any  # a path or a list of paths
    val_files: Any
    prompt_key: str
    response_key: str
    prompt_dict_keys: list[str]
    response_dict_keys: list[str]
    multiturn: MultiturnConfig
    max_length: int
    truncation: str
    train_batch_size: int
    micro_batch_size_per_gpu: int
    balance_dp_token: bool
    use_dynamic_bsz: bool | None
    max_token_len_per_gpu: int | None
    shuffle: bool
    apply_chat_template_kwargs: dict[str, Any]
    skip_bad_rows: bool
    image_key: str


def validate_data(data: DataConfig) -> None:
    validate_data_files(data, ("max_length", "train_batch_size"))


def validate_best_model(config: "SFTConfig") -> None:
    best = config.trainer.best_model
    positive("trainer.best_model.early_stopping_patience", best.early_stopping_patience, allow_none=True)
    if best.early_stopping_threshold < 0:
        raise ConfigError(f"trainer.best_model.early_stopping_threshold must be >= 0, got {best.early_stopping_threshold}")
    if (best.save or best.early_stopping_patience) and not (config.data.val_files and config.trainer.test_freq > 0):
        key = "save=true" if best.save else "early_stopping_patience"
        raise ConfigError(f"trainer.best_model.{key} reads val/loss at each validation: it needs data.val_files and trainer.test_freq > 0 "
                          f"(got val_files={config.data.val_files!r}, test_freq={config.trainer.test_freq})")


@dataclass
class SFTModelConfig(LanguageModelConfig):
    partial_pretrain: str
    strategy: str
    fsdp_config: FSDPConfig


def validate_sft_model(model: SFTModelConfig) -> None:
    if not model.partial_pretrain:
        raise ConfigError("model.partial_pretrain is required: a local Hugging Face model folder")
    if model.strategy != "fsdp2":
        raise ConfigError(f"model.strategy must be fsdp2 (the only strategy fsdptrain implements), got {model.strategy!r}")
    validate_model(model, "model")
    validate_fsdp(model.fsdp_config, "model.fsdp_config")
    for key in ("param_offload", "optimizer_offload"):
        if getattr(model.fsdp_config, key):
            raise ConfigError(f"model.fsdp_config.{key}=true moves the model off the device between the phases of an RL step; SFT has no "
                              "phase without its model. To train a model larger than the device, use model.fsdp_config.cpu_offload=true "
                              "(FSDP2's CPU offload, verl's offload_policy)")


@dataclass
class SFTOptimConfig(OptimConfig):
    clip_grad: float


@dataclass
class BestModelConfig:
    """trainer.best_model: TRL's load_best_model_at_end and EarlyStoppingCallback, on val/loss."""

    save: bool
    early_stopping_patience: int | None
    early_stopping_threshold: float


@dataclass
class SFTTrainerConfig(TrainerConfig):
    nccl_timeout: int
    best_model: BestModelConfig
    auto_resumes_from_path: ClassVar[bool] = True  # verl's SFT trainers: resume_mode=auto with resume_from_path resumes from it
    last_step_when_off: ClassVar[bool] = True  # verl's SFT trainer validates and saves at the last step whatever test_freq/save_freq say


@dataclass
class SFTConfig:
    data: DataConfig
    model: SFTModelConfig
    optim: SFTOptimConfig
    trainer: SFTTrainerConfig
    use_remove_padding: bool
    ulysses_sequence_parallel_size: int


def own_checks(config: SFTConfig) -> list[Callable[[], None]]:
    """The checks of each section's own values; the sizes that need the number of ranks are the plan's
    (trainer/sft_plan.py)."""
    return [
        lambda: validate_data(config.data),
        lambda: validate_sft_model(config.model),
        lambda: validate_optim(config.optim, "optim"),
        lambda: positive("optim.clip_grad", config.optim.clip_grad),
        lambda: validate_trainer(config.trainer),
        lambda: check_adapter_export(config.trainer.checkpoint, config.model, "model"),
        lambda: positive("trainer.nccl_timeout", config.trainer.nccl_timeout),
        lambda: validate_best_model(config),
        lambda: validate_sequence_parallel(config.ulysses_sequence_parallel_size, config.use_remove_padding, "ulysses_sequence_parallel_size",
                                           "use_remove_padding"),
    ]


def load_sft_config(cfg: DictConfig, problems: Sequence[str] = ()) -> SFTConfig:
    """Type-check an SFT config and check each section's own values: one error naming each bad key, with the
    command line's `problems` (verl_keys.translate's). The trainer reads its config with trainer/sft_plan.py's
    `read_sft_config`, which adds the plan's checks to the same error."""
    config: SFTConfig = to_typed(cfg, SFTConfig, problems)
    check_all(own_checks(config), problems)
    return config
