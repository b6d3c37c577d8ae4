"""The GRPO trainer's plan: the config and the world (the processes torchrun started) turned, once and before the
process group starts, into every setting the step's components take. It derives each size once, checks every name
against its registry and every rule that spans sections or needs the number of ranks, and reports all problems in
one error. The run, its set-up, the step and the loop read the plan; nothing below it reads the config.
"""

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from fsdptrain.config.base import check_packages, one_of, read_config
from fsdptrain.config.grpo import (
    ACTOR,
    CRITIC,
    ROLLOUT,
    CustomRewardConfig,
    DistillationConfig,
    GRPOConfig,
    GRPOTrainerConfig,
    KLControlConfig,
    RefFSDPConfig,
    RemoteRewardConfig,
    RewardSourceConfig,
    RLDataConfig,
    importance_bounds,
    own_checks,
    rejection_options,
    validate_critic,
)
from fsdptrain.config.shared import FSDPConfig, ModelConfig, logger_packages, validate_sequence_parallel
from fsdptrain.data.micro_batches import MicroBatching, validate_micro_batching
from fsdptrain.distributed.mesh import World, check_fsdp_size, check_sp_divides_world, world_from_environment
from fsdptrain.dtypes import compute_dtype, warn_if_emulated
from fsdptrain.errors import ConfigError
from fsdptrain.models.architecture import Architecture
from fsdptrain.models.loading import load_tokenizer
from fsdptrain.rl.actor import ForwardSettings, LossSettings, UpdateSettings
from fsdptrain.rl.advantages import AdvantageSettings
from fsdptrain.rl.agent.loop import AGENT_LOOPS, MultiTurnSettings
from fsdptrain.rl.agent.tool_calls import TOOL_CALL_FORMATS
from fsdptrain.rl.core_algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    EstimatorInfo,
    PolicyLossSettings,
    RejectionRule,
)
from fsdptrain.rl.critic import ValueLossSettings
from fsdptrain.rl.distillation import DistillationSettings
from fsdptrain.rl.reference_sync import ReferenceSync
from fsdptrain.rl.reward_shaping import ShapingSettings
from fsdptrain.rl.rewards import VERIFIERS, OverlongBuffer
from fsdptrain.rl.rollout import ROLLOUT_ENGINES, EngineSpec, engine_index
from fsdptrain.rl.rollout.base import EngineInfo, EnginePlacement, engine_settings
from fsdptrain.rl.rollout.beams import read_catalog
from fsdptrain.rl.rollout_correction import Correction
from fsdptrain.rl.sampling import FILTER_KEYS, RolloutRequest
from fsdptrain.trainer.setup import ModelSpec

log = logging.getLogger("fsdptrain")


@dataclass(frozen=True)
class CriticPlan:
    """PPO's critic (critic.*): how it forwards, its loss, its update and its micro-batches."""

    forward: ForwardSettings
    loss: ValueLossSettings
    update: UpdateSettings
    update_batching: MicroBatching
    forward_batching: MicroBatching


@dataclass(frozen=True)
class TeacherPlan:
    """On-policy distillation's teacher (distillation.teacher_models.teacher_model): its model and micro-batches;
    its loss is the actor's (LossSettings.distillation)."""

    spec: ModelSpec
    batching: MicroBatching


@dataclass(frozen=True)
class RewardModelPlan:
    """reward_model.*: the frozen sequence classifier (its spec) and how its score joins the others."""

    spec: ModelSpec
    weight: float
    micro_batch_size: int


@dataclass(frozen=True)
class RewardPlan:
    """Where a response's reward comes from: the reward function (or reward.sources weighted, or the entries of the
    function's dict that algorithm.gdpo_reward_keys names), then the reward model and the remote server."""

    function: CustomRewardConfig  # custom_reward_function.* or newer verl's reward.custom_reward_function.*
    sources: tuple[RewardSourceConfig, ...]
    entries: tuple[str, ...] | None
    model: RewardModelPlan | None
    remote_url: str | None
    remote: RemoteRewardConfig
    extra_info: dict[str, Any]  # what each call's extra_info gains from the reward manager (GDPO's: the experiment's name)


@dataclass(frozen=True)
class AsyncRollout:
    """verl 0.9's asynchronous trainers: separate_async generates on torchrun's last `rollout_ranks` processes and
    trains on the others (rl/rollout/remote.py); colocate_async (no rollout ranks) generates and trains on every
    rank, its unfinished responses in flight across steps (rl/rollout/in_flight.py)."""

    rollout_ranks: int
    lead: int  # prompt batches in flight ahead of the one a step trains (num_warmup_batches; with colocate_async's wait, at most max_lag)
    max_lag: int | None  # the most versions a trained group may lag the policy that trains on it (max_off_policy_threshold)
    wait: bool  # max_off_policy_strategy=wait: colocate_async trains each batch's own groups, none dropped (separate_async drops none either way)


@dataclass(frozen=True)
class GRPOPlan:
    trainer: GRPOTrainerConfig
    data: RLDataConfig
    run_config: dict  # the whole config, as checkpoints and loggers record it
    nccl_timeout: float  # actor_rollout_ref.nccl_timeout
    actor_model: ModelSpec  # actor_rollout_ref.model with the actor's FSDP and optimizer
    reference_model: ModelSpec | None  # its own; None without a KL, or under LoRA (the actor with its adapters off)
    critic_model: ModelSpec | None
    reward: RewardPlan
    kl_control: KLControlConfig | None  # algorithm.kl_ctrl, where the reward carries a KL penalty
    shaping: ShapingSettings
    tools_file: str | None  # multi-turn's tool and interaction YAMLs
    interactions_file: str | None
    sp_size: int
    sequence_length: int  # data.max_prompt_length + data.max_response_length
    forward: ForwardSettings
    loss: LossSettings
    update: UpdateSettings
    update_batching: MicroBatching
    log_prob_batching: MicroBatching  # the old policy's log-probs
    ref_batching: MicroBatching
    needs_reference: bool  # the KL loss or the KL in the reward
    reference_sync: ReferenceSync | None  # actor_rollout_ref.ref.sync_ref_model
    engine: EngineSpec
    engine_name: str
    ranked_responses: bool  # a prompt's responses are its beams, best first (validation reports HR@K and NDCG@K)
    request: RolloutRequest
    validation: RolloutRequest
    filter_metric: str | None  # dynamic sampling's (algorithm.filter_groups)
    max_gen_batches: int
    score_later: bool  # reward_model.launch_reward_fn_async
    # One mini-batch, one epoch: the old policy is the current one (ratio exactly 1), unless the reward's KL or the
    # rollout correction needs its log-probs before the loss; the engine's agreement metrics can then wait for the
    # update's forward, which computes the same log-probs.
    one_pass: bool
    add_ground_truth: bool  # rollout.add_gt
    old_from_rollout: bool  # the engine's sampling log-probs are the old policy's (rollout correction's bypass mode)
    greedy_baseline: bool  # each prompt is also answered greedily, its score the baseline (ReMax)
    sum_pi_squared: bool  # the old-policy pass also keeps each token's sum of squared probabilities (optimal token baseline)
    agreement: bool  # the engine's sampling log-probs are kept and compared with the old policy's
    correction: Correction  # off (no weights, no rejection) under bypass: the loss itself weighs
    advantage: AdvantageSettings
    mask_truncated_completions: bool
    critic_warmup: int
    weight_bucket_bytes: int
    critic: CriticPlan | None  # with a critic estimator (or critic.enable)
    teacher: TeacherPlan | None  # distillation.enabled
    multi_turn: MultiTurnSettings | None
    default_agent_loop: str  # for rows without `agent_name`
    overlong: OverlongBuffer | None
    asynchronous: AsyncRollout | None  # None: the sync mode, every rank generates, then trains

    @property
    def rollout_ranks(self) -> int:
        """separate_async's standalone rollout ranks; 0: every rank generates."""
        return self.asynchronous.rollout_ranks if self.asynchronous is not None else 0


def batching(config: GRPOConfig, size: int, size_key: str, dynamic: bool | None, max_tokens: int | None, max_tokens_key: str, packed: bool,
             prefix: str) -> MicroBatching:
    """Forward passes of `size` sequences, or (use_dynamic_bsz=null, packed rows) a token budget worth `size`
    sequences of the longest length: every RL loss here divides by the mini-batch's global counts, so the cut
    never changes it."""
    if dynamic is None:
        dynamic = packed
        if dynamic and max_tokens is None:
            max_tokens = size * sequence_length(config)
    return MicroBatching(size, dynamic, max_tokens, size_key, f"{prefix}.use_dynamic_bsz", max_tokens_key)


def actor_batching(config: GRPOConfig, size: int, size_key: str) -> MicroBatching:
    actor = config.actor_rollout_ref.actor
    return batching(config, size, size_key, actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu, f"{ACTOR}.ppo_max_token_len_per_gpu",
                    config.actor_rollout_ref.model.use_remove_padding, ACTOR)


def critic_batching(config: GRPOConfig, forward: bool) -> MicroBatching:
    """The critic's forward passes: of its values (`forward`), or of its update."""
    critic = config.critic
    size_key = "forward_micro_batch_size_per_gpu" if forward else "ppo_micro_batch_size_per_gpu"
    tokens_key = "forward_max_token_len_per_gpu" if forward else "ppo_max_token_len_per_gpu"
    return batching(config, getattr(critic, size_key), f"{CRITIC}.{size_key}", critic.use_dynamic_bsz, getattr(critic, tokens_key),
                    f"{CRITIC}.{tokens_key}", critic.model.use_remove_padding, CRITIC)


@dataclass(frozen=True)
class Derived:
    """The facts that several checks and the plan read, each derived from the config once (`derive`)."""

    estimator: EstimatorInfo | None  # the advantage estimator's declaration; None: not registered (check_names says so)
    engine: EngineInfo | None  # the rollout engine's, likewise
    uses_critic: bool  # critic.enable, or where it is null, whether the estimator reads a critic's values
    bypass: bool  # the old log-probs are the engine's (verl's bypass mode, asked for by its key or by naming its loss)
    corrects_rollouts: bool  # rollout correction in any form (weights, rejection, bypass): it reads the engine's log-probs
    sampling_log_probs: bool  # the step reads the engine's sampling log-probs (kept, compared or trained on)
    update_batching: MicroBatching  # the actor's update's forward passes
    loss_mode: str  # the policy loss the update runs (bypass_mode under bypass)
    policy_agg_mode: str  # its aggregation: the loss's own where it forces one, else actor.loss_agg_mode


def derive(config: GRPOConfig) -> Derived:
    algorithm, actor, rollout = config.algorithm, config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    estimator = ADVANTAGE_ESTIMATORS.info.get(algorithm.adv_estimator)
    needs_values = estimator is not None and estimator.needs_values
    correction = algorithm.rollout_correction
    bypass = correction.bypass_mode or actor.policy_loss.loss_mode == "bypass_mode"
    corrects = correction.rollout_is is not None or correction.rollout_rs is not None or bypass
    loss_mode = "bypass_mode" if bypass else actor.policy_loss.loss_mode
    forced = POLICY_LOSSES.info[loss_mode].agg_mode if loss_mode in POLICY_LOSSES else None  # not registered: check_names says so
    return Derived(estimator, ROLLOUT_ENGINES.info.get(rollout.name), needs_values if config.critic.enable is None else config.critic.enable,
                   bypass, corrects, rollout.calculate_log_probs or corrects,
                   actor_batching(config, actor.ppo_micro_batch_size_per_gpu, f"{ACTOR}.ppo_micro_batch_size_per_gpu"), loss_mode,
                   forced or actor.loss_agg_mode)


def check_names(config: GRPOConfig, derived: Derived) -> list:
    """Each name that selects an implementation, against its registry."""
    actor, rollout, algorithm = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout, config.algorithm
    checks = [
        lambda: POLICY_LOSSES.check(f"{ACTOR}.policy_loss.loss_mode", actor.policy_loss.loss_mode),
        lambda: LOSS_AGG_MODES.check(f"{ACTOR}.loss_agg_mode", actor.loss_agg_mode),
        lambda: KL_ESTIMATORS.check(f"{ACTOR}.kl_loss_type", actor.kl_loss_type.rstrip("+")),
        lambda: ROLLOUT_ENGINES.check(f"{ROLLOUT}.name", rollout.name),
        lambda: ADVANTAGE_ESTIMATORS.check("algorithm.adv_estimator", algorithm.adv_estimator),
    ]
    if rollout.multi_turn.enable:
        checks.append(lambda: TOOL_CALL_FORMATS.check(f"{ROLLOUT}.multi_turn.format", rollout.multi_turn.format))
    if rollout.agent.default_agent_loop is not None:
        checks.append(lambda: AGENT_LOOPS.check(f"{ROLLOUT}.agent.default_agent_loop", rollout.agent.default_agent_loop))
    if algorithm.use_kl_in_reward:
        checks.append(lambda: KL_ESTIMATORS.check("algorithm.kl_penalty", algorithm.kl_penalty.rstrip("+")))
    if config.distillation.enabled:  # the top-k forward KL, or a one-sample estimator of the KL to the teacher
        checks.append(lambda: one_of("distillation.distillation_loss.loss_mode", config.distillation.distillation_loss.loss_mode,
                                     ("forward_kl_topk", *KL_ESTIMATORS)))
    if algorithm.filter_groups.enable:
        checks.append(lambda: one_of("algorithm.filter_groups.metric", algorithm.filter_groups.metric, tuple(FILTER_KEYS)))
    for i, source in enumerate(config.reward.sources):
        if source.path is None:
            checks.append(lambda i=i, source=source: VERIFIERS.check(f"reward.sources[{i}].function", source.function))
    if derived.uses_critic:
        checks.append(lambda: LOSS_AGG_MODES.check(f"{CRITIC}.loss_agg_mode", config.critic.loss_agg_mode))
    return checks


def check_groups(config: GRPOConfig, derived: Derived) -> None:
    """What the estimator needs of the responses to one prompt and of the old policy's pass."""
    n, algorithm, needs = config.actor_rollout_ref.rollout.n, config.algorithm, derived.estimator
    estimator = algorithm.adv_estimator
    if needs is None:  # check_names' to report
        return
    if n < needs.min_group_size and not replaces_task_loss(config.distillation):
        raise ConfigError(f"algorithm.adv_estimator={estimator} compares responses of one prompt: {ROLLOUT}.n must be >= {needs.min_group_size}, got {n}")
    if algorithm.filter_groups.enable and n < 2:
        raise ConfigError(f"algorithm.filter_groups keeps the groups whose responses differ: {ROLLOUT}.n must be >= 2, got {n}")
    if needs.needs_greedy_baseline and (algorithm.reward_norm or algorithm.reward_clip):
        raise ConfigError(f"algorithm.adv_estimator={estimator} subtracts the greedy response's score from the reward: "
                          "algorithm.reward_norm and reward_clip would put the two on different scales")
    if needs.sequence_weights and derived.policy_agg_mode == "seq-mean-token-mean":
        raise ConfigError(f"algorithm.adv_estimator={estimator} weighs each response's summed log-prob: a loss aggregated as "
                          f"seq-mean-token-mean ({ACTOR}.loss_agg_mode, or loss_mode={derived.loss_mode}'s own) divides it by the response's "
                          "length; use token-mean or seq-mean-token-sum")
    if needs.needs_sum_pi_squared and derived.bypass:
        raise ConfigError(f"algorithm.adv_estimator={estimator} needs each token's sum of squared probabilities from the old policy's "
                          "forward pass, which algorithm.rollout_correction.bypass_mode skips")
    if algorithm.reward_norm == "group" and n < 2:
        raise ConfigError(f"algorithm.reward_norm=group normalizes over each prompt's responses: {ROLLOUT}.n must be >= 2, got {n}")


def replaces_task_loss(distillation: DistillationConfig) -> bool:
    """Whether the distillation loss is the actor's whole loss (no task rewards): the advantages then train nothing."""
    return distillation.enabled and not distillation.distillation_loss.use_task_rewards


def check_distillation(config: GRPOConfig, derived: Derived) -> None:
    """What on-policy distillation asks of the other sections (the teacher's own files are read with the inputs)."""
    if not config.distillation.enabled:
        return
    actor, key = config.actor_rollout_ref.actor, "distillation.enabled=true"
    if actor.skip_zero_advantage:
        raise ConfigError(f"{key} with {ACTOR}.skip_zero_advantage=true: the distillation loss trains every response, whatever its advantage")
    if derived.uses_critic and replaces_task_loss(config.distillation):
        raise ConfigError(f"{key} with distillation.distillation_loss.use_task_rewards=false and a critic (algorithm.adv_estimator="
                          f"{config.algorithm.adv_estimator}): the policy learns from the teacher alone, so nothing uses the critic's values")


def warn_about_estimates(config: GRPOConfig, derived: Derived) -> None:
    algorithm, rollout = config.algorithm, config.actor_rollout_ref.rollout
    if algorithm.use_kl_in_reward and config.actor_rollout_ref.actor.use_kl_loss:
        warnings.warn("algorithm.use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss both penalize the KL to the "
                      "reference: it is counted twice", stacklevel=3)
    if derived.corrects_rollouts and (rollout.top_p < 1 or rollout.top_k > 0):
        warnings.warn(f"algorithm.rollout_correction with {ROLLOUT}.top_p={rollout.top_p}, top_k={rollout.top_k}: the "
                      "engine samples from the truncated distribution, the trainer scores the full one, so the weights are biased",
                      stacklevel=3)


def check_critic_estimator(config: GRPOConfig, derived: Derived) -> None:
    estimator, critic_estimators = config.algorithm.adv_estimator, ADVANTAGE_ESTIMATORS.names(needs_values=True)
    if estimator in critic_estimators and not derived.uses_critic:
        raise ConfigError(f"algorithm.adv_estimator={estimator} needs the critic's values: remove critic.enable=false")
    if derived.uses_critic and estimator not in critic_estimators:
        raise ConfigError(f"critic.enable=true with algorithm.adv_estimator={estimator}: that estimator does not use the critic's "
                          f"values; use algorithm.adv_estimator={'|'.join(critic_estimators)}, or remove critic.enable")
    if config.trainer.critic_warmup and not derived.uses_critic:
        raise ConfigError(f"trainer.critic_warmup={config.trainer.critic_warmup} without a critic (algorithm.adv_estimator={estimator}, "
                          f"critic.enable={config.critic.enable}): there is nothing to warm up")


def check_critic_mesh(config: GRPOConfig) -> None:
    critic, actor_sp_size = config.critic, config.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    validate_sequence_parallel(critic.ulysses_sequence_parallel_size, critic.model.use_remove_padding, f"{CRITIC}.ulysses_sequence_parallel_size",
                               f"{CRITIC}.model.use_remove_padding")
    if critic.ulysses_sequence_parallel_size != actor_sp_size:
        raise ConfigError(f"{CRITIC}.ulysses_sequence_parallel_size ({critic.ulysses_sequence_parallel_size}) must equal "
                          f"{ACTOR}.ulysses_sequence_parallel_size ({actor_sp_size}): the run has one data x sequence parallel mesh")


def check_mini_batches(train_batch_size: int, mini_batch_size: int, key: str = f"{ACTOR}.ppo_mini_batch_size") -> None:
    if train_batch_size % mini_batch_size:
        raise ConfigError(f"data.train_batch_size ({train_batch_size}) must be divisible by {key} ({mini_batch_size})")


def check_critic_batches(config: GRPOConfig) -> None:
    check_mini_batches(config.data.train_batch_size, config.critic.ppo_mini_batch_size, f"{CRITIC}.ppo_mini_batch_size")
    for forward in (False, True):
        validate_micro_batching(critic_batching(config, forward), sequence_length(config), "data.max_prompt_length + data.max_response_length")


def check_one_reward_definition(config: GRPOConfig) -> None:
    if config.algorithm.gdpo_reward_keys is not None and (config.reward.sources or not resolve_reward_function(config).path):
        raise ConfigError("algorithm.gdpo_reward_keys names entries of the reward function's dict: give the function "
                          "(reward.custom_reward_function.path) and no reward.sources")
    if config.reward.sources and (config.custom_reward_function.path or config.reward.custom_reward_function.path):
        raise ConfigError("reward.sources with a custom_reward_function.path: list the function among the sources "
                          "({name: ..., path: FILE, function: NAME, weight: ...})")


def resolve_reward_function(config: GRPOConfig) -> CustomRewardConfig:
    """The custom reward function from custom_reward_function.* or newer verl's reward.custom_reward_function.*."""
    legacy, newer = config.custom_reward_function, config.reward.custom_reward_function
    if newer.path is None:
        if given := [key for key, value in (("name", newer.name), ("reward_kwargs", newer.reward_kwargs)) if value]:
            raise ConfigError(f"reward.custom_reward_function.{' and '.join(given)} is set without reward.custom_reward_function.path")
        return legacy
    if legacy.path is not None and legacy.path != newer.path:
        raise ConfigError(f"custom_reward_function.path ({legacy.path}) and reward.custom_reward_function.path ({newer.path}) "
                          "disagree: set one of them")
    return CustomRewardConfig(newer.path, newer.name or legacy.name, {**legacy.reward_kwargs, **newer.reward_kwargs})


def reward_sources(config: GRPOConfig) -> tuple[tuple[str, float], ...]:
    """Each reward source's name and weight, in the order the scores keep them: reward.sources (or the reward
    function's entries that algorithm.gdpo_reward_keys names), the reward model, the remote server."""
    settings, keys = config.reward_model, config.algorithm.gdpo_reward_keys
    sources = [(source.name, source.weight) for source in config.reward.sources]
    if keys is not None:
        sources = list(zip(keys, config.algorithm.gdpo_reward_weights or [1.0] * len(keys), strict=True))
    sources += [("reward_model", settings.weight)] if settings.enable else []
    sources += [("remote", settings.remote.weight)] if settings.remote_rm_url else []
    return tuple(sources)


def check_decoupled_sources(config: GRPOConfig, derived: Derived) -> None:
    """An estimator of each source's own scores (GDPO) normalizes them: a reward that is no source, or that changes
    the summed reward token by token, would be left out (verl's GDPO drops them too), so it is refused."""
    algorithm = config.algorithm
    estimator = algorithm.adv_estimator
    needs_sources = derived.estimator is not None and derived.estimator.needs_source_scores
    if algorithm.gdpo_reward_keys is not None and not needs_sources:
        readers = "|".join(ADVANTAGE_ESTIMATORS.names(needs_source_scores=True))
        raise ConfigError(f"algorithm.gdpo_reward_keys names the reward sources of an estimator that reads each ({readers}): "
                          f"algorithm.adv_estimator={estimator} reads the summed score (set adv_estimator={readers}, or drop the keys)")
    if not needs_sources:
        return
    if reward_sources(config) and not (config.reward.sources or algorithm.gdpo_reward_keys):
        raise ConfigError(f"algorithm.adv_estimator={estimator} normalizes each reward source on its own: with the reward model or the remote "
                          "server as sources, name the rule-based reward in reward.sources too (it is empty)")
    shaping = {"algorithm.use_kl_in_reward": algorithm.use_kl_in_reward, "reward_model.overlong_buffer.enable": config.reward_model.overlong_buffer.enable,
               "algorithm.reward_norm": algorithm.reward_norm, "algorithm.reward_clip": algorithm.reward_clip}
    if given := [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in shaping.items() if value not in (None, False)]:
        raise ConfigError(f"algorithm.adv_estimator={estimator} normalizes each source's scores in its group, so what changes the summed reward "
                          f"would be left out (as verl's GDPO leaves it): {', '.join(given)}. Drop it, or use grpo")


def check_reward_model_layout(config: GRPOConfig) -> None:
    sp = config.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    if config.reward_model.enable and sp > 1:
        raise ConfigError("reward_model.enable=true with actor_rollout_ref.actor.ulysses_sequence_parallel_size > 1: the reward model "
                          "scores whole sequences on each rank; sequence parallelism for it is not built yet")
    if config.reward_model.launch_reward_fn_async:
        reason = ("the reward model's forward passes are collectives of the training processes" if config.reward_model.enable else
                  "dynamic sampling filters groups on their scores before the step goes on" if config.algorithm.filter_groups.enable else
                  "the ranks of a Ulysses group share their scored groups" if sp > 1 else None)
        if reason:
            raise ConfigError(f"reward_model.launch_reward_fn_async=true cannot score in the background here: {reason}")


def check_reference_sync(config: GRPOConfig) -> None:
    ref, key = config.actor_rollout_ref.ref, "actor_rollout_ref.ref.sync_ref_model=true"
    if not ref.sync_ref_model:
        return
    if not (config.actor_rollout_ref.actor.use_kl_loss or config.algorithm.use_kl_in_reward):
        raise ConfigError(f"{key} moves the reference, which only the KL uses: set actor_rollout_ref.actor.use_kl_loss=true or "
                          "algorithm.use_kl_in_reward=true")
    if config.actor_rollout_ref.model.lora_rank:
        raise ConfigError(f"{key} with actor_rollout_ref.model.lora_rank > 0: LoRA's reference is the actor's own frozen weights "
                          "(adapters off), which the adapters train against; a moving reference needs a second model (lora_rank=0)")
    sizes = (config.actor_rollout_ref.actor.fsdp_config.fsdp_size, ref.fsdp_config.fsdp_size)
    if sizes[0] != sizes[1]:
        raise ConfigError(f"{key} mixes the policy into the reference shard by shard: actor_rollout_ref.ref.fsdp_config.fsdp_size "
                          f"({sizes[1]}) must be the actor's ({sizes[0]})")


def check_beam_search(config: GRPOConfig, derived: Derived) -> None:
    rollout, key, engine = config.actor_rollout_ref.rollout, f"{ROLLOUT}.beam_search=true", derived.engine
    if engine is None:  # check_names' to report
        return
    if rollout.catalog_file:
        if not engine.constrained:
            raise ConfigError(f"{ROLLOUT}.catalog_file constrains the engine's decoding: {ROLLOUT}.name={rollout.name} takes no prefix "
                              f"constraint here (engines that do: {', '.join(ROLLOUT_ENGINES.names(constrained=True))})")
        if rollout.multi_turn.enable:
            raise ConfigError(f"{ROLLOUT}.catalog_file with {ROLLOUT}.multi_turn.enable=true: the catalog constrains a one-turn answer")
        read_catalog(rollout.catalog_file, f"{ROLLOUT}.catalog_file")
    if not rollout.beam_search:
        return
    if not engine.beams:
        raise ConfigError(f"{key}: {ROLLOUT}.name={rollout.name} has no beam search here (engines that do: "
                          f"{', '.join(ROLLOUT_ENGINES.names(beams=True))})")
    if rollout.multi_turn.enable:
        raise ConfigError(f"{key} with {ROLLOUT}.multi_turn.enable=true: beams answer a prompt in one turn")
    if derived.sampling_log_probs:
        raise ConfigError(f"{key} gives no sampling log-probs (a beam is not sampled): set {ROLLOUT}.calculate_log_probs=false "
                          "and leave algorithm.rollout_correction off")


def rollout_engine_settings(config: GRPOConfig, world: World, info: EngineInfo | None) -> object:
    """The engine's own settings (`info.settings`), read from the rollout section by their names and checked
    against where the run's engines are."""
    rollout = config.actor_rollout_ref.rollout
    if info is None:  # check_names' to report
        return None
    # separate_async's engines are on its rollout ranks alone, n_gpus_per_node of them a host
    engines = rollout.n_gpus_per_node if rollout_ranks(config) else world.host_processes // rollout.tensor_model_parallel_size
    placement = EnginePlacement(world.device, max(engines, 1))
    return info.check(engine_settings(info, vars(rollout)), placement)


def check_add_gt(config: GRPOConfig, derived: Derived) -> None:
    rollout = config.actor_rollout_ref.rollout
    if rollout.add_gt and (rollout.multi_turn.enable or derived.sampling_log_probs):
        raise ConfigError(f"{ROLLOUT}.add_gt=true puts a response no engine sampled into a group: it has no sampling log-probs (leave "
                          f"{ROLLOUT}.calculate_log_probs=false and algorithm.rollout_correction off) and no turns (multi_turn)")


def rollout_ranks(config: GRPOConfig) -> int:
    """separate_async's standalone rollout ranks (0 in the sync mode)."""
    rollout = config.actor_rollout_ref.rollout
    if config.trainer.mode != "separate_async" or rollout.nnodes <= 0 or not rollout.n_gpus_per_node:
        return 0
    return rollout.nnodes * rollout.n_gpus_per_node


def asynchronous_rollout(config: GRPOConfig) -> AsyncRollout | None:
    """trainer.v1's asynchronous mode as the run carries it out; None in the sync mode."""
    trainer = config.trainer
    if trainer.mode == "sync":
        return None
    section = trainer.v1.separate_async if trainer.mode == "separate_async" else trainer.v1.colocate_async
    sampler = trainer.v1.sampler
    lead, max_lag, wait = section.num_warmup_batches, sampler.max_off_policy_threshold, sampler.max_off_policy_strategy == "wait"
    if trainer.mode == "colocate_async" and wait and max_lag is not None:
        lead = min(lead, max_lag)  # a group in flight no more batches ahead than keeps it within the bound: none to drop
    return AsyncRollout(rollout_ranks(config), lead, max_lag, wait)


def training_world(config: GRPOConfig, world: World) -> World:
    """The processes that train: torchrun's, less the standalone rollout ranks."""
    return replace(world, world_size=world.world_size - rollout_ranks(config))


def check_separate_async(config: GRPOConfig, world: World) -> None:
    """separate_async's placement and what it does not do yet; in the sync mode, no rollout ranks."""
    rollout, trainer, key = config.actor_rollout_ref.rollout, config.trainer, "trainer.v1.trainer_mode=separate_async"
    if trainer.mode != "separate_async":
        if rollout.nnodes:
            raise ConfigError(f"{ROLLOUT}.nnodes={rollout.nnodes} asks for standalone rollout ranks, which only {key} (with "
                              "trainer.use_v1=true) has: every rank generates, then trains")
        return
    if rollout.nnodes <= 0 or not rollout.n_gpus_per_node or rollout.n_gpus_per_node <= 0:
        raise ConfigError(f"{key} generates on standalone rollout ranks: set {ROLLOUT}.nnodes and {ROLLOUT}.n_gpus_per_node (> 0; "
                          f"got {rollout.nnodes} and {rollout.n_gpus_per_node})")
    ranks = rollout_ranks(config)
    training = world.world_size - ranks
    if training < 1:
        raise ConfigError(f"{key}: {ranks} rollout ranks ({ROLLOUT}.nnodes x n_gpus_per_node) leave none of the {world.world_size} "
                          "processes to train")
    if training % ranks:
        raise ConfigError(f"{key}: each rollout rank serves as many training ranks as the others: the {ranks} rollout ranks must divide "
                          f"the {training} training ranks ({world.world_size} processes)")
    sync_step, mini, batch = trainer.v1.separate_async.parameter_sync_step, config.actor_rollout_ref.actor.ppo_mini_batch_size, config.data.train_batch_size
    if batch != sync_step * mini:
        raise ConfigError(f"{key}: the weights go to the rollout ranks once a step, after its parameter_sync_step updates, so "
                          f"data.train_batch_size ({batch}) must equal trainer.v1.separate_async.parameter_sync_step ({sync_step}) x "
                          f"{ACTOR}.ppo_mini_batch_size ({mini}) (verl's rule)")
    if rollout.tensor_model_parallel_size != 1:
        raise ConfigError(f"{key} with {ROLLOUT}.tensor_model_parallel_size={rollout.tensor_model_parallel_size}: each standalone "
                          "rollout rank runs an engine of its own (tensor parallelism across rollout ranks is not built); set it to 1")
    sizes = {f"{ACTOR}.fsdp_config.fsdp_size": config.actor_rollout_ref.actor.fsdp_config.fsdp_size,
             "actor_rollout_ref.ref.fsdp_config.fsdp_size": config.actor_rollout_ref.ref.fsdp_config.fsdp_size,
             f"{CRITIC}.model.fsdp_config.fsdp_size": config.critic.model.fsdp_config.fsdp_size,
             "reward_model.model.fsdp_config.fsdp_size": config.reward_model.model.fsdp_config.fsdp_size}
    if hybrid := [f"{name}={size}" for name, size in sizes.items() if size not in (-1, training)]:
        raise ConfigError(f"{key} with hybrid sharding ({', '.join(hybrid)}) is not built yet: the training ranks shard over all of them")


def check_colocate_async(config: GRPOConfig) -> None:
    """What colocate_async's pool of responses in flight does not do yet."""
    rollout, trainer, key = config.actor_rollout_ref.rollout, config.trainer, "trainer.v1.trainer_mode=colocate_async"
    if trainer.mode != "colocate_async":
        return
    refused = {f"{ROLLOUT}.name={rollout.name}": rollout.name != "hf", f"{ROLLOUT}.multi_turn.enable=true": rollout.multi_turn.enable,
               f"{ROLLOUT}.beam_search=true": rollout.beam_search, f"{ROLLOUT}.catalog_file": bool(rollout.catalog_file)}
    if names := [name for name, taken in refused.items() if taken]:
        raise ConfigError(f"{key} with {', '.join(names)} is not built yet: the responses in flight are the hf engine's one-turn samples")


def check_layout(config: GRPOConfig, world: World, derived: Derived) -> None:
    """Sizes that depend on the number of (training) ranks."""
    data, actor, rollout = config.data, config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    sp, tp = actor.ulysses_sequence_parallel_size, rollout.tensor_model_parallel_size
    check_sp_divides_world(sp, world.world_size)
    check_fsdp_size(actor.fsdp_config.fsdp_size, world.world_size, f"{ACTOR}.fsdp_config.fsdp_size")
    if derived.uses_critic:
        check_fsdp_size(config.critic.model.fsdp_config.fsdp_size, world.world_size, f"{CRITIC}.model.fsdp_config.fsdp_size")
    check_fsdp_size(config.actor_rollout_ref.ref.fsdp_config.fsdp_size, world.world_size, "actor_rollout_ref.ref.fsdp_config.fsdp_size")
    if config.reward_model.enable:
        check_fsdp_size(config.reward_model.model.fsdp_config.fsdp_size, world.world_size, "reward_model.model.fsdp_config.fsdp_size")
    if config.distillation.enabled:
        check_fsdp_size(config.distillation.teacher_models.teacher_model.fsdp_config.fsdp_size, world.world_size,
                        "distillation.teacher_models.teacher_model.fsdp_config.fsdp_size")
    if world.world_size % tp:
        raise ConfigError(f"{ROLLOUT}.tensor_model_parallel_size ({tp}) must divide the number of processes ({world.world_size}): "
                          "each engine spans that many consecutive ranks")
    rollout_engine_settings(config, world, derived.engine)
    dp_size = world.world_size // sp
    if data.train_batch_size % dp_size:
        raise ConfigError(f"data.train_batch_size ({data.train_batch_size}) must be divisible by the data-parallel size ({dp_size}): "
                          "each rank generates for whole prompts")
    layouts = [(ACTOR, actor.ppo_mini_batch_size, derived.update_batching)]
    if derived.uses_critic:
        layouts.append((CRITIC, config.critic.ppo_mini_batch_size, critic_batching(config, forward=False)))
    for prefix, mini_batch_size, micro_batching in layouts:
        if mini_batch_size % dp_size:
            raise ConfigError(f"{prefix}.ppo_mini_batch_size ({mini_batch_size}) must be divisible by the data-parallel size ({dp_size})")
        per_rank = mini_batch_size // dp_size * rollout.n
        if not micro_batching.dynamic and per_rank % micro_batching.size:
            raise ConfigError(f"{prefix}.ppo_mini_batch_size / dp * n = {per_rank} sequences per rank must be divisible by "
                              f"{micro_batching.size_key} ({micro_batching.size})")


def sequence_length(config: GRPOConfig) -> int:
    return config.data.max_prompt_length + config.data.max_response_length


def plan_checks(config: GRPOConfig, world: World) -> list[Callable[[], None]]:
    """Every rule the config's own checks cannot make: names, rules across sections, the world's sizes."""
    data, actor, derived = config.data, config.actor_rollout_ref.actor, derive(config)
    return [
        *check_names(config, derived),
        lambda: check_groups(config, derived),
        lambda: validate_micro_batching(derived.update_batching, sequence_length(config), "data.max_prompt_length + data.max_response_length"),
        *([lambda: validate_critic(config.critic), lambda: check_critic_mesh(config), lambda: check_critic_batches(config)]
          if derived.uses_critic else []),
        lambda: check_critic_estimator(config, derived),
        lambda: check_one_reward_definition(config),
        lambda: resolve_reward_function(config),
        lambda: check_reward_model_layout(config),
        lambda: check_decoupled_sources(config, derived),
        lambda: check_reference_sync(config),
        lambda: check_distillation(config, derived),
        lambda: check_beam_search(config, derived),
        lambda: check_add_gt(config, derived),
        lambda: check_mini_batches(data.train_batch_size, actor.ppo_mini_batch_size),
        lambda: check_separate_async(config, world),
        lambda: check_colocate_async(config),
        lambda: check_layout(config, training_world(config, world), derived),
        *([lambda: check_packages(run_packages(config, derived.engine))] if world.here else []),
    ]


def run_packages(config: GRPOConfig, info: EngineInfo | None) -> dict[str, str]:
    """The optional packages the run imports later: its loggers', and its rollout engine's (`info`)."""
    name = config.actor_rollout_ref.rollout.name
    engine = {f"{ROLLOUT}.name={name}": info.package} if info and info.package else {}
    return {**logger_packages(config.trainer), **engine}


def read_grpo_config(cfg: DictConfig, problems: Sequence[str] = (), world: World | None = None) -> GRPOConfig:
    """The config as the trainer reads it, before any work starts: typed, then each section's own checks and the
    plan's (against `world`, by default torchrun's), every problem with the command line's `problems` in one
    ConfigError."""
    config: GRPOConfig = read_config(cfg, GRPOConfig, problems, own_checks,
                                     lambda typed: plan_checks(typed, world or world_from_environment(typed.trainer.device)))
    world = world or world_from_environment(config.trainer.device)
    derived = derive(config)
    if world.rank == 0:
        warn_about_estimates(config, derived)
        warn_if_emulated(config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype,
                         f"{ACTOR}.fsdp_config.mixed_precision.param_dtype", world.device)
        if derived.uses_critic:
            warn_if_emulated(config.critic.model.fsdp_config.mixed_precision.param_dtype, f"{CRITIC}.model.fsdp_config.mixed_precision.param_dtype",
                             world.device)
    return config


def resolve_grpo(config: GRPOConfig, world: World) -> tuple[GRPOPlan, PreTrainedTokenizerBase]:
    """The run's plan, from a config that `read_grpo_config` has checked, and the policy's tokenizer, whose pad id
    the plan takes (handed on: the run reads its inputs with it)."""
    model = config.actor_rollout_ref.model
    tokenizer = load_tokenizer(model.path, "actor_rollout_ref.model.path", model)
    return plan_grpo(config, world, tokenizer.pad_token_id), tokenizer


# long: one settings object per component, each a few lines; split up, the plan's shape would be spread over files
def plan_grpo(config: GRPOConfig, world: World, pad_id: int) -> GRPOPlan:
    """The run's plan, from a config that `read_grpo_config` has checked; `pad_id`: the policy's tokenizer's."""
    data, model, actor, rollout, ref = (config.data, config.actor_rollout_ref.model, config.actor_rollout_ref.actor,
                                        config.actor_rollout_ref.rollout, config.actor_rollout_ref.ref)
    algorithm, trainer, sp = config.algorithm, config.trainer, actor.ulysses_sequence_parallel_size
    world = training_world(config, world)
    dp = world.world_size // sp
    use_kl_in_reward = algorithm.use_kl_in_reward
    correction, policy_loss = algorithm.rollout_correction, actor.policy_loss
    derived = derive(config)
    bypass = derived.bypass
    needs_reference = actor.use_kl_loss or use_kl_in_reward
    is_upper, is_lower = importance_bounds(correction.rollout_is_threshold)
    needs = derived.estimator
    loss_mode = derived.loss_mode
    rules = tuple(RejectionRule(*rule) for rule in rejection_options(correction.rollout_rs, correction.rollout_rs_threshold))
    # bypass: verl applies the weights' normalization and the rejection in each micro-batch's loss, against the
    # current policy; otherwise once, against the old policy's pass (the Correction below)
    policy = PolicyLossSettings(*clip_range(actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high), actor.clip_ratio_c,
                                actor.tau_pos, actor.tau_neg, policy_loss.clip_cov_ratio, policy_loss.clip_cov_lb, policy_loss.clip_cov_ub,
                                policy_loss.kl_cov_ratio, policy_loss.ppo_kl_coef, policy_loss.dro_beta, policy_loss.policy_drift_coef,
                                correction.loss_type, correction.rollout_is, is_upper, is_lower,
                                bypass and correction.rollout_is_batch_normalize, rules if bypass else ())
    loss = LossSettings(loss_mode, actor.loss_agg_mode, derived.policy_agg_mode, policy,
                        actor.entropy_coeff, actor.kl_loss_coef if actor.use_kl_loss else None, actor.kl_loss_type, actor.sft_loss_coef,
                        actor.loss_scale_factor, data.max_response_length, actor.skip_zero_advantage,
                        distillation=distillation_settings(config.distillation))
    engine = EngineSpec(model.path, compute_dtype(actor.fsdp_config.mixed_precision.param_dtype, world.device), world.device, pad_id,
                        model.trust_remote_code, sequence_length(config), trainer.seed + engine_index(world.rank, rollout.tensor_model_parallel_size),
                        rollout.tensor_model_parallel_size, rollout.free_cache_engine, rollout_engine_settings(config, world, derived.engine))
    # bypass: the engine's log-probs are the old policy's, so there is nothing to compare them with, and its
    # rollout_is weighs the reinforce loss, not every loss
    rollout_is = None if bypass else correction.rollout_is
    rejection = () if bypass else rules
    agreement = not bypass and (rollout.calculate_log_probs or derived.engine.always_logs_probs or rollout_is is not None or bool(rejection))
    val = rollout.val_kwargs
    val_samples = val.do_sample and val.temperature > 0  # else greedy
    multi_turn = rollout.multi_turn
    overlong = config.reward_model.overlong_buffer
    critic = None
    if derived.uses_critic:
        critic = CriticPlan(
            ForwardSettings(config.critic.model.use_remove_padding, config.critic.model.share_prompts, chunked_loss_tokens=0, temperature=1.0,
                            pad_id=pad_id),
            ValueLossSettings(config.critic.cliprange_value, config.critic.loss_agg_mode, actor.loss_scale_factor, data.max_response_length),
            UpdateSettings(config.critic.ppo_epochs, config.critic.ppo_mini_batch_size // dp * rollout.n, config.critic.shuffle, trainer.seed,
                           config.critic.grad_clip),
            critic_batching(config, forward=False), critic_batching(config, forward=True))
    return GRPOPlan(
        sp_size=sp, sequence_length=sequence_length(config),
        forward=ForwardSettings(model.use_remove_padding, model.share_prompts, model.chunked_loss_tokens, rollout.temperature, pad_id),
        loss=loss,
        update=UpdateSettings(actor.ppo_epochs, actor.ppo_mini_batch_size // dp * rollout.n, actor.shuffle, trainer.seed, actor.grad_clip),
        update_batching=derived.update_batching,
        log_prob_batching=actor_batching(config, rollout.log_prob_micro_batch_size_per_gpu, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"),
        ref_batching=actor_batching(config, ref.log_prob_micro_batch_size_per_gpu, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
        needs_reference=needs_reference,
        reference_sync=ReferenceSync(ref.ref_model_sync_steps, ref.ref_model_mixup_alpha) if ref.sync_ref_model else None,
        engine=engine, engine_name=rollout.name, ranked_responses=rollout.beam_search,
        request=RolloutRequest(rollout.n, data.max_response_length, rollout.log_prob_micro_batch_size_per_gpu, rollout.temperature,
                               rollout.top_p, rollout.top_k, rollout.do_sample, calculate_log_probs=agreement or bypass),
        validation=RolloutRequest(val.n, data.max_response_length, rollout.log_prob_micro_batch_size_per_gpu,
                                  val.temperature if val_samples else 1.0, top_p=val.top_p if val_samples else 1.0,
                                  top_k=val.top_k if val_samples and val.top_k > 0 else -1, do_sample=val_samples, calculate_log_probs=False),
        filter_metric=algorithm.filter_groups.metric if algorithm.filter_groups.enable else None,
        max_gen_batches=algorithm.filter_groups.max_num_gen_batches,
        score_later=config.reward_model.launch_reward_fn_async,
        one_pass=(actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == data.train_batch_size and not use_kl_in_reward
                  and rollout_is is None and not rejection and not bypass and not needs.needs_old_log_probs),
        add_ground_truth=rollout.add_gt,
        old_from_rollout=bypass,
        greedy_baseline=needs.needs_greedy_baseline,
        sum_pi_squared=needs.needs_sum_pi_squared,
        agreement=agreement,
        correction=Correction(rollout_is, is_upper, is_lower, correction.rollout_is_batch_normalize, rejection),
        advantage=AdvantageSettings(algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo, algorithm.gamma, algorithm.lam,
                                    algorithm.kl_penalty, algorithm.advantage_clip, reward_sources(config), algorithm.whiten_advantages),
        mask_truncated_completions=actor.mask_truncated_completions,
        critic_warmup=trainer.critic_warmup,
        weight_bucket_bytes=rollout.update_weights_bucket_megabytes * 2**20,
        critic=critic,
        teacher=teacher_plan(config),
        multi_turn=MultiTurnSettings(multi_turn.max_assistant_turns, multi_turn.max_user_turns, multi_turn.max_parallel_calls,
                                     multi_turn.max_tool_response_length, multi_turn.tool_response_truncate_side, multi_turn.format,
                                     multi_turn.tokenization_sanity_check_mode, multi_turn.tool_timeout_s) if multi_turn.enable else None,
        default_agent_loop=rollout.agent.default_agent_loop or ("tool_agent" if multi_turn.enable else "single_turn_agent"),
        overlong=OverlongBuffer(data.max_response_length, overlong.len, overlong.penalty_factor) if overlong.enable else None,
        trainer=trainer, data=data, run_config=asdict(config), nccl_timeout=config.actor_rollout_ref.nccl_timeout,
        actor_model=ModelSpec(model.path, model, actor.fsdp_config, model.use_remove_padding, actor.optim, model.lora("actor_rollout_ref.model")),
        reference_model=(ModelSpec(model.path, model, frozen_fsdp(actor.fsdp_config, ref.fsdp_config), model.use_remove_padding)
                         if needs_reference and not model.lora_rank else None),
        critic_model=(ModelSpec(config.critic.model.path, config.critic.model, config.critic.model.fsdp_config, config.critic.model.use_remove_padding,
                                config.critic.optim) if critic is not None else None),
        reward=reward_plan(config),
        kl_control=algorithm.kl_ctrl if use_kl_in_reward else None,
        shaping=ShapingSettings(algorithm.reward_norm, algorithm.reward_norm_minus_mean or algorithm.reward_shift, not algorithm.reward_shift,
                                algorithm.reward_clip),
        tools_file=multi_turn.tool_config_path if multi_turn.enable else None,
        interactions_file=multi_turn.interaction_config_path if multi_turn.enable else None,
        asynchronous=asynchronous_rollout(config),
    )


def fit_to_architecture(plan: GRPOPlan, architecture: Architecture, critic_architecture: Architecture | None = None) -> GRPOPlan:
    """The plan with the paths the policy's `architecture` (and the critic's) computes right (models/architecture.py),
    its engine's refusal of a model type it cannot run as the trainer computes it, responses packed whole where a
    prompt cannot be shared, the old policy's log-probs from their own pass (eval mode) where the model's dropout
    would make the update's forward differ from it, and the routers' load-balancing loss where the model's config
    asks for it (the policy's: the critic trains without it)."""
    ROLLOUT_ENGINES.info[plan.engine_name].check_architecture(architecture.model_type, plan.engine)
    if architecture.vision_language:
        check_images_reach(plan, architecture.model_type)
    forward, one_pass = plan.forward, plan.one_pass
    if forward.share_prompts and not architecture.shares_prompts:
        forward = replace(forward, share_prompts=False)
        why = "has linear-attention layers" if architecture.recurrent_layers else "trains with its routers' load-balancing loss"
        log.info(f"{architecture.model_type} {why}: each response is packed with its own prompt (actor_rollout_ref.model.share_prompts "
                 "taken as false)")
    if one_pass and architecture.dropout:
        one_pass = False
        log.info(f"{architecture.model_type}'s config sets dropout ({', '.join(architecture.dropout)}): the old policy's log-probs are "
                 "taken by their own pass in eval mode, not from the update's forward")
    critic = plan.critic
    if critic is not None and critic.forward.share_prompts and critic_architecture is not None and critic_architecture.recurrent_layers:
        critic = replace(critic, forward=replace(critic.forward, share_prompts=False))
        log.info(f"the critic's {critic_architecture.model_type} has linear-attention layers: each response is packed with its own prompt "
                 "(critic.model.share_prompts taken as false)")
    return replace(plan, forward=forward, one_pass=one_pass, loss=replace(plan.loss, router_balance=architecture.router_balance), critic=critic)


def check_images_reach(plan: GRPOPlan, model_type: str) -> None:
    """A vision-language policy's images reach every part of a run (rollouts in every trainer mode, the log-probs,
    the critic, reward model and teacher, the update) but a rollout engine that cannot read them, refused by name."""
    if not ROLLOUT_ENGINES.info[plan.engine_name].images:
        raise ConfigError(f"actor_rollout_ref.model.path is a vision-language model ({model_type}); its images do not reach "
                          f"{ROLLOUT}.name={plan.engine_name}: not built for images yet (rollout engines that read them: "
                          f"{', '.join(ROLLOUT_ENGINES.names(images=True))})")


def frozen_fsdp(actor: FSDPConfig, own: RefFSDPConfig) -> FSDPConfig:
    """A frozen model's FSDP settings (the reference's, the reward model's): the actor's compute dtype and
    resharding, with its own offloads, shard group size and weights' dtype."""
    return replace(actor, cpu_offload=own.cpu_offload, fsdp_size=own.fsdp_size, model_dtype=own.model_dtype, param_offload=own.param_offload,
                   optimizer_offload=False)


def clip_range(ratio: float, low: float | None, high: float | None) -> tuple[float, float]:
    """A clipped loss's (low, high) clip ratios: each clip_ratio where not given, as verl's."""
    return (ratio if low is None else low, ratio if high is None else high)


def distillation_settings(distillation: DistillationConfig) -> DistillationSettings | None:
    if not distillation.enabled:
        return None
    loss = distillation.distillation_loss
    policy = PolicyLossSettings(*clip_range(loss.clip_ratio, loss.clip_ratio_low, loss.clip_ratio_high))  # clip_ratio_c: verl's 3
    return DistillationSettings(loss.loss_mode, loss.topk or 0, loss.use_task_rewards, loss.distillation_loss_coef, loss.loss_max_clamp,
                                loss.log_prob_min_clamp, loss.use_policy_gradient, policy)


def teacher_plan(config: GRPOConfig) -> TeacherPlan | None:
    if not config.distillation.enabled:
        return None
    teacher, key = config.distillation.teacher_models.teacher_model, "distillation.teacher_models.teacher_model"
    model = config.actor_rollout_ref.model
    loading = ModelConfig(model.trust_remote_code, enable_gradient_checkpointing=False, attn_implementation=model.attn_implementation)
    spec = ModelSpec(teacher.model_path, loading, frozen_fsdp(config.actor_rollout_ref.actor.fsdp_config, teacher.fsdp_config), model.use_remove_padding)
    return TeacherPlan(spec, actor_batching(config, teacher.log_prob_micro_batch_size_per_gpu, f"{key}.log_prob_micro_batch_size_per_gpu"))


def reward_plan(config: GRPOConfig) -> RewardPlan:
    settings, keys = config.reward_model, config.algorithm.gdpo_reward_keys
    model = None
    if settings.enable:
        reward_model = settings.model
        loading = ModelConfig(reward_model.trust_remote_code, enable_gradient_checkpointing=False,
                              attn_implementation=config.actor_rollout_ref.model.attn_implementation)
        spec = ModelSpec(reward_model.path, loading, frozen_fsdp(config.actor_rollout_ref.actor.fsdp_config, reward_model.fsdp_config),
                         reward_model.use_remove_padding)
        model = RewardModelPlan(spec, settings.weight, settings.micro_batch_size_per_gpu)
    extra_info = {"experiment_name": config.trainer.experiment_name} if config.reward.reward_manager.name == "gdpo" else {}
    return RewardPlan(resolve_reward_function(config), tuple(config.reward.sources), tuple(keys) if keys is not None else None, model,
                      settings.remote_rm_url, settings.remote, extra_info)
