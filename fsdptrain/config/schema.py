"""Typed schema of the trainer configs and their validation.

Defaults live in the YAML files beside this one; the dataclasses here only fix names and types, so a key
missing from the YAML, an unknown key or a value of the wrong type fails with its full dotted name.
"""

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdptrain.rl.core_algos import ADVANTAGE_ESTIMATORS, FILTER_METRICS, GROUP_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""


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


# ---- sections both trainers share (SFT at the top level, GRPO under actor_rollout_ref.*) -----------------------
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
    """How a model is built and its loss computed; the path and the FSDP section sit where each trainer keeps them."""

    trust_remote_code: bool
    enable_gradient_checkpointing: bool
    attn_implementation: str
    chunked_loss_tokens: int


@dataclass
class SFTModelConfig(ModelConfig):
    partial_pretrain: str
    strategy: str
    fsdp_config: FSDPConfig


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


@dataclass
class SFTOptimConfig(OptimConfig):
    clip_grad: float


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


@dataclass(frozen=True)
class MicroBatching:
    """How one rank's share of a batch is cut into forward passes, with the keys it came from (SFT and GRPO
    name them differently) so that errors name the user's key."""

    size: int
    dynamic: bool
    max_tokens: int | None
    size_key: str
    dynamic_key: str
    max_tokens_key: str


@dataclass
class SFTConfig:
    data: DataConfig
    model: SFTModelConfig
    optim: SFTOptimConfig
    trainer: TrainerConfig
    use_remove_padding: bool
    ulysses_sequence_parallel_size: int

    @property
    def micro_batching(self) -> MicroBatching:
        """data.use_dynamic_bsz=null: a token budget of micro_batch_size_per_gpu x max_length (no micro-batch holds
        more tokens than the count-based one could) where the cut cannot change the loss, else a sample count."""
        data = self.data
        dynamic, max_tokens = data.use_dynamic_bsz, data.max_token_len_per_gpu
        if dynamic is None:
            dynamic = self.use_remove_padding and data.balance_dp_token
            if dynamic and max_tokens is None:
                max_tokens = data.micro_batch_size_per_gpu * data.max_length
        return MicroBatching(
            data.micro_batch_size_per_gpu, dynamic, max_tokens,
            "data.micro_batch_size_per_gpu", "data.use_dynamic_bsz", "data.max_token_len_per_gpu",
        )


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = tuple(DTYPES)
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


def validate_model(model: ModelConfig, prefix: str) -> None:
    _one_of(f"{prefix}.attn_implementation", model.attn_implementation, ("auto", "sdpa", "eager", "flash_attention_2"))
    if model.chunked_loss_tokens < 0:
        raise ConfigError(f"{prefix}.chunked_loss_tokens must be >= 0 (0: full logits), got {model.chunked_loss_tokens}")


def validate_fsdp(fsdp: FSDPConfig, prefix: str) -> None:
    _one_of(f"{prefix}.model_dtype", fsdp.model_dtype, DTYPE_NAMES)
    _one_of(f"{prefix}.mixed_precision.param_dtype", fsdp.mixed_precision.param_dtype, DTYPE_NAMES + (None,))
    _one_of(f"{prefix}.mixed_precision.reduce_dtype", fsdp.mixed_precision.reduce_dtype, DTYPE_NAMES)


def validate_optim(optim: OptimConfig, prefix: str) -> None:
    _positive(f"{prefix}.lr", optim.lr)
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        raise ConfigError(f"{prefix}.betas must be two numbers in [0, 1), got {optim.betas!r}")
    if optim.weight_decay < 0:
        raise ConfigError(f"{prefix}.weight_decay must be >= 0, got {optim.weight_decay!r}")
    if not 0 <= optim.lr_warmup_steps_ratio <= 1:
        raise ConfigError(f"{prefix}.lr_warmup_steps_ratio must be in [0, 1], got {optim.lr_warmup_steps_ratio!r}")
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps < 0:
        raise ConfigError(f"{prefix}.lr_warmup_steps must be >= 0, got {optim.lr_warmup_steps!r}")
    _one_of(f"{prefix}.lr_scheduler", optim.lr_scheduler, ("cosine", "wsd", "constant"))
    if not 0 <= optim.min_lr_ratio <= 1:
        raise ConfigError(f"{prefix}.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio!r}")
    if not 0 < optim.wsd_decay_ratio <= 1:
        raise ConfigError(f"{prefix}.wsd_decay_ratio must be in (0, 1], got {optim.wsd_decay_ratio!r}")


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
    _one_of("trainer.checkpoint.hf_dtype", trainer.checkpoint.hf_dtype, DTYPE_NAMES + (None,))
    for name in trainer.logger:
        _one_of("trainer.logger", name, LOGGERS)
    _one_of("trainer.device", trainer.device, ("auto", "cpu", "cuda"))
    _positive("trainer.profile_step", trainer.profile_step, allow_none=True)


def validate_micro_batching(batching: MicroBatching, max_length: int, max_length_key: str) -> None:
    _positive(batching.size_key, batching.size)
    if batching.dynamic:
        if batching.max_tokens is None:
            raise ConfigError(f"{batching.max_tokens_key} is required when {batching.dynamic_key}=true")
        if batching.max_tokens < max_length:
            raise ConfigError(
                f"{batching.max_tokens_key} ({batching.max_tokens}) must be >= {max_length_key} ({max_length}) "
                "so that every sample fits one micro-batch"
            )


def validate_data(data: DataConfig) -> None:
    data.train_files = _as_path_list("data.train_files", data.train_files)
    if not data.train_files:
        raise ConfigError("data.train_files is required")
    data.val_files = _as_path_list("data.val_files", data.val_files)
    _positive("data.max_length", data.max_length)
    _one_of("data.truncation", data.truncation, ("error", "left", "right"))
    _positive("data.train_batch_size", data.train_batch_size)


def validate_sequence_parallel(sp_size: int, packed: bool, sp_key: str, packed_key: str) -> None:
    _positive(sp_key, sp_size)
    if sp_size > 1 and not packed:
        raise ConfigError(f"{sp_key} > 1 needs {packed_key}=true (it splits packed rows)")


def load_sft_config(cfg: DictConfig) -> SFTConfig:
    """Type-check and validate an SFT config; every error names its key."""
    config: SFTConfig = to_typed(cfg, SFTConfig)
    validate_data(config.data)
    validate_micro_batching(config.micro_batching, config.data.max_length, "data.max_length")
    if not config.model.partial_pretrain:
        raise ConfigError("model.partial_pretrain is required: a local Hugging Face model folder")
    if config.model.strategy != "fsdp2":
        raise ConfigError(f"model.strategy must be fsdp2 (the only strategy fsdptrain implements), got {config.model.strategy!r}")
    validate_model(config.model, "model")
    validate_fsdp(config.model.fsdp_config, "model.fsdp_config")
    validate_optim(config.optim, "optim")
    _positive("optim.clip_grad", config.optim.clip_grad)
    validate_trainer(config.trainer)
    validate_sequence_parallel(
        config.ulysses_sequence_parallel_size, config.use_remove_padding, "ulysses_sequence_parallel_size", "use_remove_padding"
    )
    return config


def check_batch_layout(batch_size: int, batch_size_key: str, batching: MicroBatching, dp_size: int) -> None:
    """Sizes that depend on the number of data-parallel ranks, checked once the world is known."""
    if batch_size % dp_size:
        raise ConfigError(f"{batch_size_key} ({batch_size}) must be divisible by the data-parallel size ({dp_size})")
    per_rank = batch_size // dp_size
    if not batching.dynamic and per_rank % batching.size:
        raise ConfigError(
            f"{batch_size_key} / dp = {batch_size} / {dp_size} = {per_rank} samples per rank "
            f"must be divisible by {batching.size_key} ({batching.size})"
        )


# ---- GRPO (verl's ppo_trainer.yaml names) -------------------------------------------------------------------------
@dataclass
class RLDataConfig:
    train_files: Any
    val_files: Any
    max_prompt_length: int
    max_response_length: int
    train_batch_size: int
    filter_overlong_prompts: bool
    truncation: str
    shuffle: bool
    apply_chat_template_kwargs: dict[str, Any]


@dataclass
class RLModelConfig(ModelConfig):
    path: str
    use_remove_padding: bool
    share_prompts: bool


@dataclass
class PolicyLossConfig:
    loss_mode: str


@dataclass
class ActorConfig:
    optim: OptimConfig
    grad_clip: float
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_gpu: int
    use_dynamic_bsz: bool | None
    ppo_max_token_len_per_gpu: int | None
    ppo_epochs: int
    shuffle: bool
    clip_ratio: float
    clip_ratio_low: float | None
    clip_ratio_high: float | None
    clip_ratio_c: float
    policy_loss: PolicyLossConfig
    loss_agg_mode: str
    loss_scale_factor: float | None
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    ulysses_sequence_parallel_size: int
    fsdp_config: FSDPConfig
    mask_truncated_completions: bool


@dataclass
class ValKwargsConfig:
    n: int
    temperature: float
    do_sample: bool


@dataclass
class RolloutConfig:
    name: str
    n: int
    temperature: float
    top_p: float
    top_k: int
    do_sample: bool
    calculate_log_probs: bool
    log_prob_micro_batch_size_per_gpu: int
    val_kwargs: ValKwargsConfig
    update_weights_bucket_megabytes: int
    tensor_model_parallel_size: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enforce_eager: bool
    free_cache_engine: bool
    load_format: str


@dataclass
class RefFSDPConfig:
    param_offload: bool


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int
    fsdp_config: RefFSDPConfig


@dataclass
class ActorRolloutRefConfig:
    model: RLModelConfig
    actor: ActorConfig
    rollout: RolloutConfig
    ref: RefConfig


@dataclass
class KLControlConfig:
    type: str
    kl_coef: float
    target_kl: float
    horizon: int


@dataclass
class FilterGroupsConfig:
    enable: bool
    metric: str
    max_num_gen_batches: int


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None
    rollout_is_threshold: float


@dataclass
class AlgorithmConfig:
    adv_estimator: str
    norm_adv_by_std_in_grpo: bool
    gamma: float
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: KLControlConfig
    filter_groups: FilterGroupsConfig
    rollout_correction: RolloutCorrectionConfig


@dataclass
class CustomRewardConfig:
    path: str | None
    name: str | None


@dataclass
class RewardConfig:
    custom_reward_function: CustomRewardConfig


@dataclass
class OverlongBufferConfig:
    enable: bool
    len: int
    penalty_factor: float


@dataclass
class RewardModelConfig:
    overlong_buffer: OverlongBufferConfig


@dataclass
class GRPOTrainerConfig(TrainerConfig):
    val_before_train: bool
    rollout_data_dir: str | None
    plot_freq: int


@dataclass
class GRPOConfig:
    data: RLDataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    algorithm: AlgorithmConfig
    custom_reward_function: CustomRewardConfig
    reward: RewardConfig
    reward_model: RewardModelConfig
    trainer: GRPOTrainerConfig

    @property
    def sequence_length(self) -> int:
        return self.data.max_prompt_length + self.data.max_response_length

    def micro_batching(self, size: int, size_key: str) -> MicroBatching:
        """Forward passes of `size` sequences, or (use_dynamic_bsz=null, packed rows) a token budget worth `size`
        sequences of the longest length: every RL loss here divides by the mini-batch's global counts, so the cut
        never changes it."""
        actor = self.actor_rollout_ref.actor
        dynamic, max_tokens = actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu
        if dynamic is None:
            dynamic = self.actor_rollout_ref.model.use_remove_padding
            if dynamic and max_tokens is None:
                max_tokens = size * self.sequence_length
        prefix = "actor_rollout_ref.actor."
        return MicroBatching(size, dynamic, max_tokens, size_key, prefix + "use_dynamic_bsz", prefix + "ppo_max_token_len_per_gpu")


def grpo_defaults() -> DictConfig:
    return OmegaConf.load(os.path.join(os.path.dirname(__file__), "grpo_trainer.yaml"))


def load_grpo_config(cfg: DictConfig) -> GRPOConfig:
    """Type-check and validate a GRPO config; every error names its key and its numbers."""
    config: GRPOConfig = to_typed(cfg, GRPOConfig)
    data, model = config.data, config.actor_rollout_ref.model
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    data.train_files = _as_path_list("data.train_files", data.train_files)
    if not data.train_files:
        raise ConfigError("data.train_files is required")
    data.val_files = _as_path_list("data.val_files", data.val_files)
    for key in ("max_prompt_length", "max_response_length", "train_batch_size"):
        _positive(f"data.{key}", getattr(data, key))
    _one_of("data.truncation", data.truncation, ("error", "left", "right"))
    if not model.path:
        raise ConfigError("actor_rollout_ref.model.path is required: a local Hugging Face model folder")
    validate_model(model, "actor_rollout_ref.model")
    validate_fsdp(actor.fsdp_config, "actor_rollout_ref.actor.fsdp_config")
    validate_optim(actor.optim, "actor_rollout_ref.actor.optim")
    validate_trainer(config.trainer)
    if config.trainer.plot_freq == 0 or config.trainer.plot_freq < -1:
        raise ConfigError(f"trainer.plot_freq must be -1 (at the end only) or > 0, got {config.trainer.plot_freq}")
    for key in ("grad_clip", "ppo_mini_batch_size", "ppo_epochs", "clip_ratio"):
        _positive(f"actor_rollout_ref.actor.{key}", getattr(actor, key))
    validate_micro_batching(config.micro_batching(actor.ppo_micro_batch_size_per_gpu, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
                            config.sequence_length, "data.max_prompt_length + data.max_response_length")
    if actor.clip_ratio_c <= 1:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual clip bounds -A * c), got {actor.clip_ratio_c}")
    _one_of("actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, POLICY_LOSSES)
    _one_of("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    _one_of("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type.rstrip("+"), KL_ESTIMATORS)
    validate_sequence_parallel(actor.ulysses_sequence_parallel_size, model.use_remove_padding,
                               "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor_rollout_ref.model.use_remove_padding")
    _one_of("actor_rollout_ref.rollout.name", rollout.name, ("hf", "vllm"))
    if rollout.name == "vllm":
        _positive("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout.tensor_model_parallel_size)
        if rollout.tensor_model_parallel_size > 1 and actor.ulysses_sequence_parallel_size > 1:
            raise ConfigError("actor_rollout_ref.rollout.tensor_model_parallel_size > 1 with actor.ulysses_sequence_parallel_size > 1 is "
                              "not supported: both split the ranks' prompts")
        if not 0 < rollout.gpu_memory_utilization <= 1:
            raise ConfigError(f"actor_rollout_ref.rollout.gpu_memory_utilization must be in (0, 1], got {rollout.gpu_memory_utilization}")
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            _positive(f"actor_rollout_ref.rollout.{key}", getattr(rollout, key))
        _one_of("actor_rollout_ref.rollout.load_format", rollout.load_format, ("dummy", "auto", "safetensors"))
    elif rollout.tensor_model_parallel_size != 1:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} needs "
                          "actor_rollout_ref.rollout.name=vllm (the hf engine runs a whole model on every rank)")
    _positive("actor_rollout_ref.rollout.n", rollout.n)
    _positive("actor_rollout_ref.rollout.temperature", rollout.temperature)
    if rollout.update_weights_bucket_megabytes < 0:
        raise ConfigError(f"actor_rollout_ref.rollout.update_weights_bucket_megabytes must be >= 0, got {rollout.update_weights_bucket_megabytes}")
    _positive("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", rollout.log_prob_micro_batch_size_per_gpu)
    _positive("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu)
    algorithm = config.algorithm
    _one_of("algorithm.adv_estimator", algorithm.adv_estimator, ADVANTAGE_ESTIMATORS)
    if config.algorithm.adv_estimator in GROUP_ESTIMATORS and rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={config.algorithm.adv_estimator} compares responses of one prompt: "
                          f"actor_rollout_ref.rollout.n must be >= 2, got {rollout.n}")
    overlong = config.reward_model.overlong_buffer
    if overlong.enable and not 0 < overlong.len <= data.max_response_length:
        raise ConfigError(f"reward_model.overlong_buffer.len must be in (0, data.max_response_length={data.max_response_length}], "
                          f"got {overlong.len}")
    if data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(f"data.train_batch_size ({data.train_batch_size}) must be divisible by "
                          f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size})")
    if algorithm.use_kl_in_reward:
        _one_of("algorithm.kl_penalty", algorithm.kl_penalty.rstrip("+"), KL_ESTIMATORS)
        _one_of("algorithm.kl_ctrl.type", algorithm.kl_ctrl.type, ("fixed", "adaptive"))
        if algorithm.kl_ctrl.type == "adaptive":
            _positive("algorithm.kl_ctrl.horizon", algorithm.kl_ctrl.horizon)
            _positive("algorithm.kl_ctrl.target_kl", algorithm.kl_ctrl.target_kl)
        if actor.use_kl_loss:
            warnings.warn("algorithm.use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss both penalize the KL to the "
                          "reference: it is counted twice", stacklevel=2)
    filter_groups = algorithm.filter_groups
    if filter_groups.enable:
        _one_of("algorithm.filter_groups.metric", filter_groups.metric, FILTER_METRICS)
        _positive("algorithm.filter_groups.max_num_gen_batches", filter_groups.max_num_gen_batches)
        if filter_groups.metric == "seq_final_reward" and algorithm.use_kl_in_reward:
            raise ConfigError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: groups are "
                              "filtered before the log-probs that the reward's KL penalty needs; use seq_reward")
    correction = algorithm.rollout_correction
    _one_of("algorithm.rollout_correction.rollout_is", correction.rollout_is, (None, "token", "sequence"))
    if correction.rollout_is is not None:
        _positive("algorithm.rollout_correction.rollout_is_threshold", correction.rollout_is_threshold)
        if rollout.top_p < 1 or rollout.top_k > 0:
            warnings.warn(f"algorithm.rollout_correction with actor_rollout_ref.rollout.top_p={rollout.top_p}, top_k={rollout.top_k}: the "
                          "engine samples from the truncated distribution, the trainer scores the full one, so the weights are biased",
                          stacklevel=2)
    config.custom_reward_function = _reward_function(config)
    if actor.policy_loss.loss_mode == "gspo" and actor.loss_agg_mode != "seq-mean-token-mean":
        warnings.warn(f"GSPO is defined with loss_agg_mode=seq-mean-token-mean; got {actor.loss_agg_mode}", stacklevel=2)
    return config


def _reward_function(config: GRPOConfig) -> CustomRewardConfig:
    """The custom reward function from custom_reward_function.* or newer verl's reward.custom_reward_function.*."""
    legacy, newer = config.custom_reward_function, config.reward.custom_reward_function
    if newer.path is None:
        if newer.name is not None:
            raise ConfigError("reward.custom_reward_function.name is set without reward.custom_reward_function.path")
        return legacy
    if legacy.path is not None and legacy.path != newer.path:
        raise ConfigError(f"custom_reward_function.path ({legacy.path}) and reward.custom_reward_function.path ({newer.path}) "
                          "disagree: set one of them")
    return CustomRewardConfig(newer.path, newer.name or legacy.name)


def check_rl_layout(config: GRPOConfig, dp_size: int, world_size: int) -> None:
    """Sizes that depend on the number of ranks, checked once the world is known."""
    data, actor, n = config.data, config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout.n
    tp = config.actor_rollout_ref.rollout.tensor_model_parallel_size
    if world_size % tp:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp}) must divide the number of processes ({world_size}): "
                          "each engine spans that many consecutive ranks")
    if data.train_batch_size % dp_size:
        raise ConfigError(f"data.train_batch_size ({data.train_batch_size}) must be divisible by the data-parallel size ({dp_size}): "
                          "each rank generates for whole prompts")
    if actor.ppo_mini_batch_size % dp_size:
        raise ConfigError(f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size}) must be divisible by the "
                          f"data-parallel size ({dp_size})")
    per_rank = actor.ppo_mini_batch_size // dp_size * n
    batching = config.micro_batching(actor.ppo_micro_batch_size_per_gpu, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    if not batching.dynamic and per_rank % actor.ppo_micro_batch_size_per_gpu:
        raise ConfigError(f"ppo_mini_batch_size / dp * n = {per_rank} sequences per rank must be divisible by "
                          f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu ({actor.ppo_micro_batch_size_per_gpu})")
