"""The GRPO trainer's config (verl's ppo_trainer.yaml names): each section followed by its own checks.

This is the ground floor: it imports nothing of fsdptrain's but the config's own modules and `errors`. Names that
select an implementation (estimators, losses, engines, verifiers, tool-call formats) are plain strings here; the
plan (trainer/grpo_plan.py) checks them against their registries, with every rule that spans sections or needs
the number of ranks, and derives the sizes.
"""

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from fsdptrain.config.base import check_all, one_of, positive, to_typed
from fsdptrain.config.shared import (
    DTYPE_NAMES,
    FSDPConfig,
    LanguageModelConfig,
    ModelConfig,
    OptimConfig,
    TrainerConfig,
    check_adapter_export,
    validate_data_files,
    validate_fsdp,
    validate_fsdp_size,
    validate_model,
    validate_optim,
    validate_sequence_parallel,
    validate_trainer,
)
from fsdptrain.errors import ConfigError

ACTOR, ROLLOUT, CRITIC = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"


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
    image_key: str


@dataclass
class RLModelConfig(LanguageModelConfig):
    path: str
    use_remove_padding: bool
    share_prompts: bool


def validate_rl_model(model: RLModelConfig) -> None:
    if not model.path:
        raise ConfigError("actor_rollout_ref.model.path is required: a local Hugging Face model folder")
    validate_model(model, "actor_rollout_ref.model")


@dataclass
class PolicyLossConfig:
    loss_mode: str
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    ppo_kl_coef: float
    dro_beta: float | None
    policy_drift_coef: float


def validate_policy_loss(actor: "ActorConfig") -> None:
    loss, key = actor.policy_loss, f"{ACTOR}.policy_loss"
    if loss.loss_mode == "dro" and (loss.dro_beta is None or loss.dro_beta <= 0):
        raise ConfigError(f"{key}.loss_mode=dro needs {key}.dro_beta > 0 (its quadratic log-ratio penalty), got {loss.dro_beta}")
    if loss.loss_mode in ("clip_cov", "kl_cov"):
        positive(f"{key}.{loss.loss_mode}_ratio", getattr(loss, f"{loss.loss_mode}_ratio"))
    if loss.loss_mode == "sapo":
        positive(f"{ACTOR}.tau_pos", actor.tau_pos)
        positive(f"{ACTOR}.tau_neg", actor.tau_neg)
    if loss.loss_mode == "cpgd" and (actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio) >= 1:
        raise ConfigError(f"{ACTOR}.policy_loss.loss_mode=cpgd clips the log-ratio at log(1 - clip_ratio_low): "
                          f"{ACTOR}.clip_ratio_low must be < 1")


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
    tau_pos: float
    tau_neg: float
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
    skip_zero_advantage: bool
    sft_loss_coef: float


def validate_actor(actor: ActorConfig, packed: bool) -> None:
    validate_fsdp(actor.fsdp_config, f"{ACTOR}.fsdp_config")
    validate_optim(actor.optim, f"{ACTOR}.optim")
    for key in ("grad_clip", "ppo_mini_batch_size", "ppo_epochs", "clip_ratio"):
        positive(f"{ACTOR}.{key}", getattr(actor, key))
    if actor.clip_ratio_c <= 1:
        raise ConfigError(f"{ACTOR}.clip_ratio_c must be > 1 (dual clip bounds -A * c), got {actor.clip_ratio_c}")
    validate_sequence_parallel(actor.ulysses_sequence_parallel_size, packed, f"{ACTOR}.ulysses_sequence_parallel_size",
                               "actor_rollout_ref.model.use_remove_padding")
    if actor.sft_loss_coef < 0:
        raise ConfigError(f"{ACTOR}.sft_loss_coef must be >= 0, got {actor.sft_loss_coef}")
    if actor.skip_zero_advantage and actor.sft_loss_coef:
        raise ConfigError(f"{ACTOR}.skip_zero_advantage=true with {ACTOR}.sft_loss_coef={actor.sft_loss_coef}: the SFT term trains a "
                          "correct response whatever its advantage")
    if actor.skip_zero_advantage and (actor.entropy_coeff != 0 or actor.use_kl_loss):
        raise ConfigError(f"{ACTOR}.skip_zero_advantage=true needs {ACTOR}.entropy_coeff=0 and {ACTOR}.use_kl_loss=false (got "
                          f"{actor.entropy_coeff} and {str(actor.use_kl_loss).lower()}): those terms train a response whatever its advantage")
    validate_policy_loss(actor)
    if actor.policy_loss.loss_mode == "gspo" and actor.loss_agg_mode != "seq-mean-token-mean":
        warnings.warn(f"GSPO is defined with loss_agg_mode=seq-mean-token-mean; got {actor.loss_agg_mode}", stacklevel=3)


@dataclass
class ValKwargsConfig:
    n: int
    temperature: float
    top_k: int
    top_p: float
    do_sample: bool


@dataclass
class MultiTurnConfig:
    enable: bool
    max_assistant_turns: int | None
    max_user_turns: int | None
    tool_config_path: str | None
    interaction_config_path: str | None
    max_parallel_calls: int
    max_tool_response_length: int
    tool_response_truncate_side: str
    tool_timeout_s: float
    format: str
    tokenization_sanity_check_mode: str


def validate_multi_turn(multi_turn: MultiTurnConfig) -> None:
    key = f"{ROLLOUT}.multi_turn"
    if not multi_turn.enable:
        return
    if not (multi_turn.tool_config_path or multi_turn.interaction_config_path):
        raise ConfigError(f"{key}.enable=true needs {key}.tool_config_path or {key}.interaction_config_path: with neither, a rollout has "
                          "one turn (leave multi_turn.enable=false)")
    for name in ("max_assistant_turns", "max_user_turns"):
        positive(f"{key}.{name}", getattr(multi_turn, name), allow_none=True)
    for name in ("max_parallel_calls", "max_tool_response_length", "tool_timeout_s"):
        positive(f"{key}.{name}", getattr(multi_turn, name))
    one_of(f"{key}.tool_response_truncate_side", multi_turn.tool_response_truncate_side, ("left", "middle", "right"))
    one_of(f"{key}.tokenization_sanity_check_mode", multi_turn.tokenization_sanity_check_mode, ("strict", "ignore_strippable", "disable"))


@dataclass
class AgentConfig:
    default_agent_loop: str | None


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
    gpu_memory_utilization: float | None  # None: the largest share that fits the host (CPU), verl's 0.5 (GPU)
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enforce_eager: bool
    enable_prefix_caching: bool
    free_cache_engine: bool
    load_format: str
    multi_turn: MultiTurnConfig
    agent: AgentConfig
    beam_search: bool  # MiniOneRec's: each prompt's n responses are its n beams, best first (the hf engine)
    catalog_file: str | None  # responses constrained to its items (a MiniOneRec index, or one item a line)
    add_gt: bool  # MiniOneRec's: a group without its prompt's ground truth holds it in place of its last member
    nnodes: int  # separate_async's standalone rollout ranks: nnodes x n_gpus_per_node
    n_gpus_per_node: int | None  # None: as many as the training ranks


def validate_rollout(rollout: RolloutConfig, sp_size: int) -> None:
    if rollout.name == "vllm":
        positive(f"{ROLLOUT}.tensor_model_parallel_size", rollout.tensor_model_parallel_size)
        if rollout.tensor_model_parallel_size > 1 and sp_size > 1:
            raise ConfigError(f"{ROLLOUT}.tensor_model_parallel_size > 1 with actor.ulysses_sequence_parallel_size > 1 is "
                              "not supported: both split the ranks' prompts")
        if rollout.gpu_memory_utilization is not None and not 0 < rollout.gpu_memory_utilization <= 1:
            raise ConfigError(f"{ROLLOUT}.gpu_memory_utilization must be in (0, 1], got {rollout.gpu_memory_utilization}")
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            positive(f"{ROLLOUT}.{key}", getattr(rollout, key))
        one_of(f"{ROLLOUT}.load_format", rollout.load_format, ("dummy", "auto", "safetensors"))
    elif rollout.tensor_model_parallel_size != 1:
        raise ConfigError(f"{ROLLOUT}.tensor_model_parallel_size={rollout.tensor_model_parallel_size} needs "
                          f"{ROLLOUT}.name=vllm (the hf engine runs a whole model on every rank)")
    positive(f"{ROLLOUT}.n", rollout.n)
    positive(f"{ROLLOUT}.temperature", rollout.temperature)
    if rollout.update_weights_bucket_megabytes < 0:
        raise ConfigError(f"{ROLLOUT}.update_weights_bucket_megabytes must be >= 0, got {rollout.update_weights_bucket_megabytes}")
    positive(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", rollout.log_prob_micro_batch_size_per_gpu)
    validate_multi_turn(rollout.multi_turn)


@dataclass
class RefFSDPConfig:
    """A frozen model's (the reference's, the reward model's) own FSDP settings; the rest are the actor's."""

    param_offload: bool
    cpu_offload: bool
    fsdp_size: int  # its own, as in verl (-1 by default, whatever the actor's)
    model_dtype: str  # its weights' dtype, its own as in verl (fp32 by default); computed in the actor's param_dtype


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int
    fsdp_config: RefFSDPConfig
    sync_ref_model: bool  # TRL's names: every ref_model_sync_steps steps, ref <- alpha * policy + (1 - alpha) * ref
    ref_model_sync_steps: int
    ref_model_mixup_alpha: float


def validate_ref(ref: RefConfig) -> None:
    prefix = "actor_rollout_ref.ref"
    positive(f"{prefix}.log_prob_micro_batch_size_per_gpu", ref.log_prob_micro_batch_size_per_gpu)
    positive(f"{prefix}.ref_model_sync_steps", ref.ref_model_sync_steps)
    validate_fsdp_size(ref.fsdp_config.fsdp_size, f"{prefix}.fsdp_config.fsdp_size")
    one_of(f"{prefix}.fsdp_config.model_dtype", ref.fsdp_config.model_dtype, DTYPE_NAMES)
    if not 0 < ref.ref_model_mixup_alpha <= 1:
        raise ConfigError(f"{prefix}.ref_model_mixup_alpha must be in (0, 1], got {ref.ref_model_mixup_alpha}")


@dataclass
class ActorRolloutRefConfig:
    nccl_timeout: int
    model: RLModelConfig
    actor: ActorConfig
    rollout: RolloutConfig
    ref: RefConfig


@dataclass
class DistillationLossConfig:
    loss_mode: str
    topk: int | None
    use_task_rewards: bool
    distillation_loss_coef: float
    loss_max_clamp: float | None
    log_prob_min_clamp: float | None
    use_policy_gradient: bool
    policy_loss_mode: str
    clip_ratio: float
    clip_ratio_low: float | None
    clip_ratio_high: float | None


@dataclass
class TeacherModelConfig:
    model_path: str | None
    log_prob_micro_batch_size_per_gpu: int
    fsdp_config: RefFSDPConfig


@dataclass
class TeacherModelsConfig:
    teacher_model: TeacherModelConfig


@dataclass
class DistillationConfig:
    enabled: bool
    distillation_loss: DistillationLossConfig
    teacher_models: TeacherModelsConfig


def validate_distillation(distillation: DistillationConfig) -> None:
    if not distillation.enabled:
        return
    loss, key = distillation.distillation_loss, "distillation.distillation_loss"
    teacher, teacher_key = distillation.teacher_models.teacher_model, "distillation.teacher_models.teacher_model"
    if not teacher.model_path:
        raise ConfigError(f"distillation.enabled=true needs {teacher_key}.model_path: the teacher's local Hugging Face model folder")
    one_of(f"{key}.policy_loss_mode", loss.policy_loss_mode, ("vanilla",))
    if loss.loss_mode == "forward_kl_topk" and (loss.topk is None or loss.topk < 1):
        raise ConfigError(f"{key}.loss_mode=forward_kl_topk needs {key}.topk >= 1, got {loss.topk}")
    if loss.loss_mode == "k1" and not loss.use_policy_gradient:
        raise ConfigError(f"{key}.loss_mode=k1 with {key}.use_policy_gradient=false: the gradient of k1 (log pi - log teacher) "
                          f"does not depend on the teacher; use k1 as a reward ({key}.use_policy_gradient=true) or another loss_mode")
    if loss.loss_max_clamp is not None and loss.loss_max_clamp <= 0:
        raise ConfigError(f"{key}.loss_max_clamp must be > 0 (or null), got {loss.loss_max_clamp}")
    positive(f"{key}.clip_ratio", loss.clip_ratio)
    positive(f"{teacher_key}.log_prob_micro_batch_size_per_gpu", teacher.log_prob_micro_batch_size_per_gpu)
    validate_fsdp_size(teacher.fsdp_config.fsdp_size, f"{teacher_key}.fsdp_config.fsdp_size")
    one_of(f"{teacher_key}.fsdp_config.model_dtype", teacher.fsdp_config.model_dtype, DTYPE_NAMES)
    if loss.loss_mode == "forward_kl_topk" and loss.use_policy_gradient:
        warnings.warn(f"{key}.loss_mode=forward_kl_topk with use_policy_gradient=true: the policy gradient moves only the "
                      "sampled token's log-prob, so the teacher's top-k distribution is mostly unused (verl warns likewise)", stacklevel=3)


@dataclass
class CriticModelConfig(ModelConfig):
    path: str
    use_remove_padding: bool
    share_prompts: bool
    fsdp_config: FSDPConfig


@dataclass
class CriticConfig:
    enable: bool | None
    optim: OptimConfig
    model: CriticModelConfig
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_gpu: int
    forward_micro_batch_size_per_gpu: int
    use_dynamic_bsz: bool | None
    ppo_max_token_len_per_gpu: int | None
    forward_max_token_len_per_gpu: int | None
    ulysses_sequence_parallel_size: int
    ppo_epochs: int
    shuffle: bool
    grad_clip: float
    cliprange_value: float
    loss_agg_mode: str


def validate_critic(critic: CriticConfig) -> None:
    validate_model(critic.model, f"{CRITIC}.model")
    validate_fsdp(critic.model.fsdp_config, f"{CRITIC}.model.fsdp_config")
    validate_optim(critic.optim, f"{CRITIC}.optim")
    for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "forward_micro_batch_size_per_gpu", "ppo_epochs", "grad_clip",
                "cliprange_value"):
        positive(f"{CRITIC}.{key}", getattr(critic, key))


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
    rollout_is_threshold: Any  # an upper bound, or "lower_upper"
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: Any  # one per rollout_rs option (or one for all), comma-separated
    bypass_mode: bool
    loss_type: str


@dataclass
class AlgorithmConfig:
    adv_estimator: str
    norm_adv_by_std_in_grpo: bool
    gamma: float
    lam: float
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: KLControlConfig
    filter_groups: FilterGroupsConfig
    rollout_correction: RolloutCorrectionConfig
    reward_norm: str | None
    reward_norm_minus_mean: bool
    reward_shift: bool
    reward_scale: bool
    reward_clip: float | None
    advantage_clip: float | None
    whiten_advantages: bool | None
    gdpo_reward_keys: list[str] | None
    gdpo_reward_weights: list[float] | None


def validate_algorithm(algorithm: AlgorithmConfig) -> None:
    for key in ("gamma", "lam"):
        if not 0 <= getattr(algorithm, key) <= 1:
            raise ConfigError(f"algorithm.{key} must be in [0, 1], got {getattr(algorithm, key)}")
    if algorithm.use_kl_in_reward:
        one_of("algorithm.kl_ctrl.type", algorithm.kl_ctrl.type, ("fixed", "adaptive"))
        if algorithm.kl_ctrl.type == "adaptive":
            positive("algorithm.kl_ctrl.horizon", algorithm.kl_ctrl.horizon)
            positive("algorithm.kl_ctrl.target_kl", algorithm.kl_ctrl.target_kl)
    filter_groups = algorithm.filter_groups
    if filter_groups.enable:
        if filter_groups.metric == "seq_final_reward" and algorithm.use_kl_in_reward:
            raise ConfigError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: groups are "
                              "filtered before the log-probs that the reward's KL penalty needs; use seq_reward")
    if algorithm.gdpo_reward_keys is not None:
        validate_gdpo_keys(algorithm)
    correction = algorithm.rollout_correction
    one_of("algorithm.rollout_correction.rollout_is", correction.rollout_is, (None, "token", "sequence"))
    one_of("algorithm.rollout_correction.loss_type", correction.loss_type, ("ppo_clip", "reinforce"))
    importance_bounds(correction.rollout_is_threshold)
    rejection_options(correction.rollout_rs, correction.rollout_rs_threshold)


def validate_gdpo_keys(algorithm: AlgorithmConfig) -> None:
    keys, weights = algorithm.gdpo_reward_keys, algorithm.gdpo_reward_weights
    if not keys or len(set(keys)) != len(keys) or any(not key or "/" in key for key in keys):
        raise ConfigError(f"algorithm.gdpo_reward_keys={keys}: list the reward function's entries, each once (without '/')")
    if weights is not None and len(weights) != len(keys):
        raise ConfigError(f"algorithm.gdpo_reward_weights has {len(weights)} weights for {len(keys)} algorithm.gdpo_reward_keys")


RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_OPTIONS = tuple(f"{level}_{kind}" for level in RS_LEVELS for kind in ("k1", "k2", "k3") if (level, kind) != ("seq_max", "k1"))


def ratio_bounds(key: str, spec: Any) -> tuple[float | None, float]:
    """A threshold in verl's grammar, "upper" or "lower_upper", as (lower or None, upper): positive numbers, lower
    no more than upper."""

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{key}: {text!r} is not a number") from None
        positive(key, value)
        return value

    lower, _, upper = str(spec).strip().rpartition("_")
    upper_value = number(upper)
    if not lower:
        return None, upper_value
    lower_value = number(lower)
    if lower_value > upper_value:
        raise ConfigError(f"{key}={spec}: the lower bound exceeds the upper")
    return lower_value, upper_value


def importance_bounds(threshold: Any) -> tuple[float, float | None]:
    """algorithm.rollout_correction.rollout_is_threshold as (upper, lower): a number caps the weights (truncated
    IS); "lower_upper" zeroes those outside (IcePop), as verl's."""
    lower, upper = ratio_bounds("algorithm.rollout_correction.rollout_is_threshold", threshold)
    return upper, lower


def rejection_options(options: str | None, thresholds: Any) -> list[tuple[str, str, float | None, float]]:
    """algorithm.rollout_correction.rollout_rs (comma-separated options, each `level_kind`) with their thresholds, as
    (level, kind, low, high), verl's grammar: one threshold for all or one per option; a k1 option takes
    "lower_upper" or an upper alone (its lower 1/upper), its bounds on the ratio, kept as logs; the others an upper bound."""
    key, threshold_key = "algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs_threshold"
    if options is None:
        return []
    names = list(dict.fromkeys(option.strip() for option in str(options).split(",") if option.strip()))
    for name in names:
        if name not in RS_OPTIONS:
            raise ConfigError(f"{key}: {name!r} is not one of {', '.join(RS_OPTIONS)}")
    if not names:
        raise ConfigError(f"{key}={options!r} names no option; null turns rejection off")
    if thresholds is None:
        raise ConfigError(f"{key}={options} needs {threshold_key} (one per option, comma-separated, or one for all)")
    specs = [spec.strip() for spec in str(thresholds).split(",") if spec.strip()]
    if len(specs) not in (1, len(names)):
        raise ConfigError(f"{threshold_key}={thresholds}: {len(specs)} thresholds for {len(names)} options of {key}; give one for all "
                          "or one per option")
    rules = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
        level, kind = name.rsplit("_", 1)
        low, high = ratio_bounds(threshold_key, spec)
        if kind != "k1":
            if low is not None:
                raise ConfigError(f"{threshold_key}: {name} takes an upper bound alone, got {spec!r}")
            rules.append((level, kind, None, high))
        else:
            rules.append((level, kind, math.log(low if low is not None else 1.0 / high), math.log(high)))
    return rules


def validate_reward_shaping(algorithm: AlgorithmConfig) -> None:
    if (algorithm.reward_shift or algorithm.reward_scale) and algorithm.reward_norm is None:
        raise ConfigError(f"algorithm.reward_{'shift' if algorithm.reward_shift else 'scale'}=true says how algorithm.reward_norm "
                          "normalizes, and reward_norm is null: set it to batch, group or running")
    if algorithm.reward_shift and (algorithm.reward_scale or algorithm.reward_norm_minus_mean):
        raise ConfigError("algorithm.reward_shift=true only subtracts the mean; it cannot go with reward_scale=true (only divides by "
                          "the std) or reward_norm_minus_mean=true (both)")
    if algorithm.reward_scale and algorithm.reward_norm_minus_mean:
        raise ConfigError("algorithm.reward_scale=true only divides by the std; it cannot go with reward_norm_minus_mean=true (which "
                          "also subtracts the mean)")
    check_all([lambda: one_of("algorithm.reward_norm", algorithm.reward_norm, (None, "batch", "group", "running")),
               lambda: positive("algorithm.reward_clip", algorithm.reward_clip, allow_none=True),
               lambda: positive("algorithm.advantage_clip", algorithm.advantage_clip, allow_none=True)])


@dataclass
class CustomRewardConfig:
    path: str | None
    name: str | None
    reward_kwargs: dict[str, Any]  # verl's: keyword arguments every call of the function is given


@dataclass
class RewardSourceConfig:
    name: str
    function: str
    path: str | None = None
    weight: float = 1.0


@dataclass
class RewardManagerConfig:
    name: str  # naive | gdpo (verl's reward loop managers; gdpo's calls also name the experiment in extra_info)


@dataclass
class RewardConfig:
    custom_reward_function: CustomRewardConfig
    reward_manager: RewardManagerConfig
    sources: list[RewardSourceConfig]


def validate_reward_sources(sources: list[RewardSourceConfig]) -> None:
    names = [source.name for source in sources]
    for i, source in enumerate(sources):
        key = f"reward.sources[{i}]"
        if not source.name or "/" in source.name or source.name in names[:i]:
            raise ConfigError(f"{key}.name={source.name!r}: each source needs its own name (without '/'; it names its metric)")
        if not math.isfinite(source.weight):
            raise ConfigError(f"{key}.weight must be a finite number, got {source.weight}")


@dataclass
class OverlongBufferConfig:
    enable: bool
    len: int
    penalty_factor: float


@dataclass
class RewardModelModelConfig:
    path: str | None
    input_tokenizer: str | None
    trust_remote_code: bool
    use_remove_padding: bool
    fsdp_config: RefFSDPConfig


@dataclass
class RemoteRewardConfig:
    weight: float
    batch_size: int
    max_concurrency: int
    timeout_s: float
    retries: int
    backoff_s: float


@dataclass
class RewardModelConfig:
    enable: bool
    weight: float
    model: RewardModelModelConfig
    micro_batch_size_per_gpu: int
    remote_rm_url: str | None
    remote: RemoteRewardConfig
    launch_reward_fn_async: bool
    overlong_buffer: OverlongBufferConfig


def validate_reward_model(reward_model: RewardModelConfig, max_response_length: int) -> None:
    remote = reward_model.remote
    if reward_model.remote_rm_url is not None:
        if not reward_model.remote_rm_url.startswith(("http://", "https://")):
            raise ConfigError(f"reward_model.remote_rm_url must be an http(s) URL, got {reward_model.remote_rm_url!r}")
        for key in ("batch_size", "max_concurrency", "timeout_s"):
            positive(f"reward_model.remote.{key}", getattr(remote, key))
        if remote.retries < 0 or remote.backoff_s < 0 or not math.isfinite(remote.weight):
            raise ConfigError("reward_model.remote: retries and backoff_s must be >= 0 and weight a finite number, got "
                              f"{remote.retries}, {remote.backoff_s}, {remote.weight}")
    if reward_model.enable:
        if not reward_model.model.path:
            raise ConfigError("reward_model.enable=true needs reward_model.model.path: a sequence-classification model folder")
        validate_fsdp_size(reward_model.model.fsdp_config.fsdp_size, "reward_model.model.fsdp_config.fsdp_size")
        one_of("reward_model.model.fsdp_config.model_dtype", reward_model.model.fsdp_config.model_dtype, DTYPE_NAMES)
        positive("reward_model.micro_batch_size_per_gpu", reward_model.micro_batch_size_per_gpu)
        if not math.isfinite(reward_model.weight):
            raise ConfigError(f"reward_model.weight must be a finite number, got {reward_model.weight}")
    overlong = reward_model.overlong_buffer
    if overlong.enable and not 0 < overlong.len <= max_response_length:
        raise ConfigError(f"reward_model.overlong_buffer.len must be in (0, data.max_response_length={max_response_length}], "
                          f"got {overlong.len}")


@dataclass
class SeparateAsyncConfig:
    num_warmup_batches: int
    parameter_sync_step: int


@dataclass
class ColocateAsyncConfig:
    num_warmup_batches: int


@dataclass
class SamplerConfig:
    max_off_policy_threshold: int | None
    max_off_policy_strategy: str


@dataclass
class V1Config:
    """verl 0.9's v1 trainer: its mode and the asynchronous modes' settings."""

    trainer_mode: str
    separate_async: SeparateAsyncConfig
    colocate_async: ColocateAsyncConfig
    sampler: SamplerConfig


@dataclass
class GRPOTrainerConfig(TrainerConfig):
    val_before_train: bool
    rollout_data_dir: str | None
    critic_warmup: int
    use_v1: bool
    v1: V1Config

    @property
    def mode(self) -> str:
        """The v1 trainer's mode; verl's older trainer (use_v1=false) is the sync one."""
        return self.v1.trainer_mode if self.use_v1 else "sync"


def validate_grpo_trainer(trainer: GRPOTrainerConfig) -> None:
    validate_trainer(trainer)
    if trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup must be >= 0, got {trainer.critic_warmup}")
    v1 = trainer.v1
    one_of("trainer.v1.trainer_mode", v1.trainer_mode, ("sync", "separate_async", "colocate_async"))
    one_of("trainer.v1.sampler.max_off_policy_strategy", v1.sampler.max_off_policy_strategy, ("drop", "wait"))
    if v1.sampler.max_off_policy_threshold is not None and v1.sampler.max_off_policy_threshold < 0:
        raise ConfigError(f"trainer.v1.sampler.max_off_policy_threshold must be >= 0 or null, got {v1.sampler.max_off_policy_threshold}")
    positive("trainer.v1.separate_async.parameter_sync_step", v1.separate_async.parameter_sync_step)
    for mode, warmup in (("separate_async", v1.separate_async.num_warmup_batches), ("colocate_async", v1.colocate_async.num_warmup_batches)):
        if warmup < 0:
            raise ConfigError(f"trainer.v1.{mode}.num_warmup_batches must be >= 0, got {warmup}")


@dataclass
class GRPOConfig:
    data: RLDataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    critic: CriticConfig
    algorithm: AlgorithmConfig
    custom_reward_function: CustomRewardConfig
    reward: RewardConfig
    reward_model: RewardModelConfig
    distillation: DistillationConfig
    trainer: GRPOTrainerConfig


def own_checks(config: GRPOConfig) -> list[Callable[[], None]]:
    """The checks of each section's own values. The rules that span sections, the names of registered
    implementations and the sizes that need the number of ranks are the plan's (trainer/grpo_plan.py)."""
    data, model = config.data, config.actor_rollout_ref.model
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    return [
        lambda: validate_data_files(data, ("max_prompt_length", "max_response_length", "train_batch_size")),
        lambda: validate_rl_model(model),
        lambda: positive("actor_rollout_ref.nccl_timeout", config.actor_rollout_ref.nccl_timeout),
        lambda: validate_actor(actor, model.use_remove_padding),
        lambda: validate_grpo_trainer(config.trainer),
        lambda: check_adapter_export(config.trainer.checkpoint, model, "actor_rollout_ref.model"),
        lambda: validate_rollout(rollout, actor.ulysses_sequence_parallel_size),
        lambda: validate_ref(config.actor_rollout_ref.ref),
        lambda: validate_distillation(config.distillation),
        lambda: validate_algorithm(config.algorithm),
        lambda: validate_reward_shaping(config.algorithm),
        lambda: validate_reward_model(config.reward_model, data.max_response_length),
        lambda: validate_reward_sources(config.reward.sources),
        lambda: one_of("reward.reward_manager.name", config.reward.reward_manager.name, ("naive", "gdpo")),
    ]


def load_grpo_config(cfg: DictConfig, problems: Sequence[str] = ()) -> GRPOConfig:
    """Type-check a GRPO config and check each section's own values: one error naming each bad key and its
    numbers, with the command line's `problems` (verl_keys.translate's). The trainer reads its config with
    trainer/grpo_plan.py's `read_grpo_config`, which adds the plan's checks to the same error."""
    config: GRPOConfig = to_typed(cfg, GRPOConfig, problems)
    check_all(own_checks(config), problems)
    return config
