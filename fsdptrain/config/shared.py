"""The config sections both trainers share (SFT keeps them at the top level, GRPO under actor_rollout_ref.*), each
followed by its validation, which takes the section's key prefix so that an error names the user's key."""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from fsdptrain.config.base import PACKAGES, as_path_list, check_all, one_of, positive
from fsdptrain.errors import ConfigError

DTYPE_NAMES = ("fp32", "bf16")  # the names dtypes.DTYPES maps to torch's dtypes
TRUNCATIONS = ("error", "left", "right")


@dataclass
class MixedPrecisionConfig:
    param_dtype: str | None
    reduce_dtype: str


@dataclass
class FSDPConfig:
    model_dtype: str
    mixed_precision: MixedPrecisionConfig
    cpu_offload: bool  # FSDP2's CPUOffloadPolicy (verl's offload_policy)
    param_offload: bool  # verl's: the shards in host memory between the phases that use them (distributed/offload.py)
    optimizer_offload: bool  # verl's: the optimizer state in host memory except during the update
    reshard_after_forward: bool
    fsdp_size: int  # -1: shard over every rank; else over groups of this many, replicated across them (HSDP)


def validate_fsdp_size(fsdp_size: int, key: str) -> None:
    if fsdp_size != -1 and fsdp_size < 1:
        raise ConfigError(f"{key} must be -1 (every rank) or a positive group size, got {fsdp_size}")


def validate_fsdp(fsdp: FSDPConfig, prefix: str) -> None:
    validate_fsdp_size(fsdp.fsdp_size, f"{prefix}.fsdp_size")
    one_of(f"{prefix}.model_dtype", fsdp.model_dtype, DTYPE_NAMES)
    one_of(f"{prefix}.mixed_precision.param_dtype", fsdp.mixed_precision.param_dtype, DTYPE_NAMES + (None,))
    one_of(f"{prefix}.mixed_precision.reduce_dtype", fsdp.mixed_precision.reduce_dtype, DTYPE_NAMES)


@dataclass
class ModelConfig:
    """How a model is built; the path and the FSDP section sit where each trainer keeps them."""

    trust_remote_code: bool
    enable_gradient_checkpointing: bool
    attn_implementation: str
    enable_activation_offload: bool = field(default=False, kw_only=True)  # a trained model's layers keep their activations in host memory


@dataclass(frozen=True)
class LoRASettings:
    """Low-rank adapters on the model's linear layers (verl's keys; peft's meaning); `key` is the prefix of those keys."""

    key: str
    rank: int
    alpha: float
    target_modules: str | list[str]  # "all-linear", module names, or a regular expression over module paths
    exclude_modules: str | list[str] | None
    dropout: float


@dataclass
class LanguageModelConfig(ModelConfig):
    """A model trained through its output layer (the policy; SFT's model): how its token losses are computed, and
    whether it trains low-rank adapters instead of its weights."""

    chunked_loss_tokens: int
    use_liger: bool
    added_tokens_file: str | None  # tokens the tokenizer and the token matrices gain (models/added_tokens.py)
    added_tokens_init: str  # their new rows: mean (transformers' mean_resizing) | pieces (the mean of their text's old tokens)
    freeze_llm: bool  # MiniOneRec's freeze_LLM: only the added tokens' rows train
    freeze_vision_tower: bool  # a vision-language model's vision encoder stays as loaded
    lora_rank: int
    lora_alpha: float
    target_modules: Any
    exclude_modules: Any
    lora_dropout: float

    def lora(self, key: str) -> LoRASettings | None:
        """The adapters' settings (this section's keys under `key`); None (full fine-tuning) with lora_rank=0."""
        if not self.lora_rank:
            return None
        return LoRASettings(key, self.lora_rank, self.lora_alpha, self.target_modules, self.exclude_modules, self.lora_dropout)


def validate_model(model: ModelConfig, prefix: str) -> None:
    one_of(f"{prefix}.attn_implementation", model.attn_implementation, ("auto", "sdpa", "eager", "flash_attention_2"))
    if isinstance(model, LanguageModelConfig):
        if model.chunked_loss_tokens < 0:
            raise ConfigError(f"{prefix}.chunked_loss_tokens must be >= 0 (0: full logits), got {model.chunked_loss_tokens}")
        one_of(f"{prefix}.added_tokens_init", model.added_tokens_init, ("mean", "pieces"))
        if model.freeze_llm and not model.added_tokens_file:
            raise ConfigError(f"{prefix}.freeze_llm=true trains the added tokens' rows alone: name them with {prefix}.added_tokens_file")
        if model.freeze_llm and model.lora_rank:
            raise ConfigError(f"{prefix}.freeze_llm=true with {prefix}.lora_rank > 0: train the added tokens' rows or adapters, not both")
        validate_lora(model, prefix)


def validate_lora(model: LanguageModelConfig, prefix: str) -> None:
    if model.lora_rank < 0:
        raise ConfigError(f"{prefix}.lora_rank must be >= 0 (0: full fine-tuning), got {model.lora_rank}")
    if not model.lora_rank:
        return

    def dropout() -> None:
        if not 0 <= model.lora_dropout < 1:
            raise ConfigError(f"{prefix}.lora_dropout must be in [0, 1), got {model.lora_dropout}")

    def module_names(key: str) -> None:
        value = getattr(model, key)
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"{prefix}.{key} must be all-linear, a module name or a list of them, got {value!r}")

    check_all([lambda: positive(f"{prefix}.lora_alpha", model.lora_alpha), dropout, lambda: module_names("target_modules"),
               lambda: model.exclude_modules is None or module_names("exclude_modules")])


@dataclass
class OptimConfig:
    lr: float
    betas: list[float]
    weight_decay: float
    lr_warmup_steps_ratio: float
    lr_warmup_steps: int | None
    lr_scheduler: str
    min_lr_ratio: float
    wsd_decay_ratio: float


def validate_optim(optim: OptimConfig, prefix: str) -> None:
    positive(f"{prefix}.lr", optim.lr)
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        raise ConfigError(f"{prefix}.betas must be two numbers in [0, 1), got {optim.betas!r}")
    if optim.weight_decay < 0:
        raise ConfigError(f"{prefix}.weight_decay must be >= 0, got {optim.weight_decay!r}")
    if not 0 <= optim.lr_warmup_steps_ratio <= 1:
        raise ConfigError(f"{prefix}.lr_warmup_steps_ratio must be in [0, 1], got {optim.lr_warmup_steps_ratio!r}")
    one_of(f"{prefix}.lr_scheduler", optim.lr_scheduler, ("cosine", "wsd", "constant"))
    if not 0 <= optim.min_lr_ratio <= 1:
        raise ConfigError(f"{prefix}.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio!r}")
    if not 0 < optim.wsd_decay_ratio <= 1:
        raise ConfigError(f"{prefix}.wsd_decay_ratio must be in (0, 1], got {optim.wsd_decay_ratio!r}")


@dataclass
class CheckpointConfig:
    save_contents: list[str]
    load_contents: list[str] | None
    hf_dtype: str | None


@dataclass
class CpuSpeedupsConfig:
    keep_freed_host_memory: bool
    point_to_point_collectives: bool
    tied_embedding_grad_in_place: bool


@dataclass
class TrainerConfig:
    auto_resumes_from_path: ClassVar[bool] = False  # verl's PPO trainer: resume_mode=auto resumes default_local_dir's latest, whatever resume_from_path says
    last_step_when_off: ClassVar[bool] = False  # verl's PPO trainer: test_freq/save_freq <= 0 never validate or save, not even at the last step
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
    cpu_speedups: CpuSpeedupsConfig
    plot_freq: int


LOGGERS = ("console", "file", "wandb", "tensorboard")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model", "lora_adapter")


def validate_trainer(trainer: TrainerConfig) -> None:
    positive("trainer.total_epochs", trainer.total_epochs)
    positive("trainer.total_training_steps", trainer.total_training_steps, allow_none=True)
    positive("trainer.max_ckpt_to_keep", trainer.max_ckpt_to_keep, allow_none=True)
    one_of("trainer.resume_mode", trainer.resume_mode, ("auto", "disable", "resume_path"))
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ConfigError("trainer.resume_from_path is required when trainer.resume_mode=resume_path")
    for key, contents in (
        ("trainer.checkpoint.save_contents", trainer.checkpoint.save_contents),
        ("trainer.checkpoint.load_contents", trainer.checkpoint.load_contents or []),
    ):
        for item in contents:
            one_of(key, item, CHECKPOINT_CONTENTS)
    one_of("trainer.checkpoint.hf_dtype", trainer.checkpoint.hf_dtype, DTYPE_NAMES + (None,))
    for name in trainer.logger:
        one_of("trainer.logger", name, LOGGERS)
    one_of("trainer.device", trainer.device, ("auto", "cpu", "cuda"))
    positive("trainer.profile_step", trainer.profile_step, allow_none=True)
    if trainer.plot_freq == 0 or trainer.plot_freq < -1:
        raise ConfigError(f"trainer.plot_freq must be -1 (at the end only) or > 0, got {trainer.plot_freq}")


def logger_packages(trainer: TrainerConfig) -> dict[str, str]:
    return {f"trainer.logger={name}": name for name in trainer.logger if name in PACKAGES}


def check_adapter_export(checkpoint: CheckpointConfig, model: LanguageModelConfig, prefix: str) -> None:
    if "lora_adapter" in checkpoint.save_contents and not model.lora_rank:
        raise ConfigError(f"trainer.checkpoint.save_contents holds lora_adapter, which needs {prefix}.lora_rank > 0 (no adapters are trained)")
    if "lora_adapter" in (checkpoint.load_contents or []):
        raise ConfigError("trainer.checkpoint.load_contents: lora_adapter is an export; the adapters resume from `model`")


def validate_data_files(data: Any, sizes: tuple[str, ...]) -> None:
    """What SFT and RL data sections share: the files (a path or a list, made a list here), the positive sizes
    named in `sizes` (keys of `data`), and the truncation side."""
    data.train_files = as_path_list("data.train_files", data.train_files)
    if not data.train_files:
        raise ConfigError("data.train_files is required")
    data.val_files = as_path_list("data.val_files", data.val_files)
    for key in sizes:
        positive(f"data.{key}", getattr(data, key))
    one_of("data.truncation", data.truncation, TRUNCATIONS)


def validate_sequence_parallel(sp_size: int, packed: bool, sp_key: str, packed_key: str) -> None:
    positive(sp_key, sp_size)
    if sp_size > 1 and not packed:
        raise ConfigError(f"{sp_key} > 1 needs {packed_key}=true (it splits packed rows)")
