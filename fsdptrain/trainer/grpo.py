"""GRPO-family training, and PPO with a critic, on the shared set-up. A step: draw and score groups of responses,
old and reference log-probs, the critic's values (PPO), rewards and advantages, the critic's update (PPO), the
clipped policy update over mini-batches, the new weights to the rollout engine. Each line of `GRPOStep.__call__`
is a call into one of the rl/ components, which this file builds from the config once.

Each data-parallel rank generates for whole prompts (train_batch_size / dp of them, `rollout.n` responses each),
so a prompt's group of responses sits on one rank (the ranks of a Ulysses group share theirs and each trains on a
slice of every sequence). Batch-wide statistics (REINFORCE++ whitening, the mini-batch's token and sequence counts
that every loss divides by, the metrics) are summed over the data-parallel group, which holds each sample once.
"""

import os
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import AutoModelForTokenClassification

from fsdptrain.config.grpo import GRPOConfig, check_rl_layout
from fsdptrain.config.shared import MicroBatching, ModelConfig
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import max_over_ranks
from fsdptrain.dtypes import compute_dtype
from fsdptrain.errors import ConfigError
from fsdptrain.evaluate import validate_on_ranks
from fsdptrain.logging.profiler import profile_step
from fsdptrain.models.loading import load_model_config, load_tokenizer
from fsdptrain.models.lora import adapters_disabled, has_adapters
from fsdptrain.rl import core_algos
from fsdptrain.rl.actor import ForwardSettings, LossSettings, PolicyActor, UpdateSettings, compute_log_probs
from fsdptrain.rl.advantages import critic_advantages, outcome_rewards, penalize_kl, put_token_values, token_advantages
from fsdptrain.rl.agent.interactions import BaseInteraction, check_interaction_names, load_interactions
from fsdptrain.rl.agent.loop import AgentLoop, MultiTurnSettings
from fsdptrain.rl.agent.tools import BaseTool, load_tools, tool_schemas
from fsdptrain.rl.critic import Critic, ValueLossSettings
from fsdptrain.rl.data import load_prompts
from fsdptrain.rl.metrics import critic_metrics, dump_rollouts, multi_turn_metrics, plot, source_metrics, step_metrics
from fsdptrain.rl.remote_reward import RemoteReward
from fsdptrain.rl.reward_model import RewardModel, same_tokenizer
from fsdptrain.rl.reward_shaping import RewardShaping, RunningMoments, clip_advantages
from fsdptrain.rl.rewards import BatchSource, OverlongBuffer, RewardFn, Scorer, load_reward_function, load_reward_sources, no_reward, weighted_sources
from fsdptrain.rl.rollout import EngineSpec, build_rollout, engine_index, sync_weights
from fsdptrain.rl.rollout.base import RolloutEngine
from fsdptrain.rl.rollout.vllm import EngineSettings
from fsdptrain.rl.rollout_correction import rollout_agreement
from fsdptrain.rl.samples import make_samples
from fsdptrain.rl.sampling import Group, GroupSampler, PromptCursor, RolloutRequest, fit_prompts
from fsdptrain.trainer.optim import build_optimizer, build_scheduler
from fsdptrain.trainer.runtime import peak_memory_gb
from fsdptrain.trainer.setup import (
    Run,
    StepTimer,
    build_sharded_model,
    claim_run_directory,
    count_steps,
    lost_ranks_named,
    open_run,
    start_run,
)


@dataclass
class StepResult:
    groups: list[Group]
    response_advantages: list[float]  # each response's mean advantage over its trained tokens
    metrics: dict[str, float]


@dataclass
class GRPOStep:
    """The parts a step passes through, and the step itself."""

    config: GRPOConfig
    actor: PolicyActor
    reference: nn.Module | None  # with the KL loss or the KL in the reward; with LoRA, the actor's model (adapters off)
    ref_batching: MicroBatching
    engine: RolloutEngine
    sampler: GroupSampler
    critic: Critic | None  # PPO's (a critic estimator)
    kl_ctrl: core_algos.KLController | None  # the KL in the reward
    shaping: RewardShaping  # reward normalization and clipping
    # One mini-batch, one epoch: the old policy is the current one (ratio exactly 1), unless the reward's KL or the
    # rollout correction needs its log-probs before the loss; the engine's agreement metrics can then wait for the
    # update's forward, which computes the same log-probs.
    one_pass: bool
    agreement: bool  # the engine's sampling log-probs are kept and compared with the old policy's

    def __call__(self, timer: StepTimer) -> StepResult:
        config, parallel = self.config, self.actor.parallel
        algorithm, correction = config.algorithm, config.algorithm.rollout_correction
        with timer("gen"):
            groups, metrics = self.sampler.next_groups()
        generations = [generation for g in groups for generation in g.generations]
        samples = make_samples(generations, config.actor_rollout_ref.actor.mask_truncated_completions)
        if not self.one_pass:
            with timer("old_log_prob"):
                self.actor.log_probs(samples, "old_log_prob")
            if self.agreement:
                metrics.update(rollout_agreement(samples, generations, correction.rollout_is, correction.rollout_is_threshold, parallel))
        if self.reference is not None:
            with timer("ref"), adapters_disabled(self.reference):
                compute_log_probs(self.reference, samples, self.ref_batching, self.actor.forward, parallel, "ref_log_prob")
        if self.critic is not None:
            with timer("values"):
                self.critic.values(samples)
        with timer("reward"):
            self.sampler.wait_for_scores(groups)
            scored = [s for g in groups for s in g.scored]
            scores = torch.tensor([s["seq_reward"] for s in scored])
            metrics.update(source_metrics(scored, parallel))
            rewards, shaping_metrics = self.shaping(scores, parallel)
            metrics.update(shaping_metrics)
            token_rewards = outcome_rewards(rewards, generations)
            if self.kl_ctrl is not None:
                metrics.update(penalize_kl(token_rewards, samples, generations, self.kl_ctrl, algorithm.kl_penalty, parallel))
        with timer("adv"):
            if self.critic is not None:
                advantages, returns = critic_advantages(token_rewards, samples, generations, algorithm.adv_estimator, algorithm.gamma,
                                                        algorithm.lam, parallel)
                put_token_values(samples, generations, returns, "returns")
            else:
                advantages = token_advantages(token_rewards, generations, config.actor_rollout_ref.rollout.n, algorithm.adv_estimator,
                                              algorithm.norm_adv_by_std_in_grpo, algorithm.gamma, parallel)
            if algorithm.advantage_clip is not None:
                metrics.update(clip_advantages(advantages, generations, algorithm.advantage_clip, parallel))
            put_token_values(samples, generations, advantages, "advantage")
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(critic_metrics(samples, generations, parallel))
                metrics.update(self.critic.update(samples))
        if timer.step > config.trainer.critic_warmup:
            with timer("update_actor"):
                metrics.update(self.actor.update(samples, first_pass_is_old=self.one_pass))
            if self.agreement and self.one_pass:  # the old log-probs came from the update's forward, of the samples it forwarded
                forwarded = [i for i, sample in enumerate(samples) if "old_log_prob" in sample.token_values]
                metrics.update(rollout_agreement([samples[i] for i in forwarded], [generations[i] for i in forwarded], correction.rollout_is,
                                                 correction.rollout_is_threshold, parallel))
            with timer("update_weights"):
                self.sync_weights()
        response_advantages = [float(a[g.mask > 0].mean()) for a, g in zip(advantages, generations)]
        prompts = [g.prompt for g in groups]
        metrics.update(step_metrics(prompts, generations, scores, token_rewards, response_advantages, config.actor_rollout_ref.rollout.n, parallel))
        if self.sampler.agent is not None:
            metrics.update(multi_turn_metrics(generations, parallel))
        return StepResult(groups, response_advantages, metrics)

    def sync_weights(self) -> None:
        self.engine.wake_up()  # the weights go to the engine's own memory, not to what it parks while asleep
        sync_weights(self.actor.model, self.engine, self.config.actor_rollout_ref.rollout.update_weights_bucket_megabytes * 2**20)


def run_grpo(config: GRPOConfig) -> None:
    parallel = start_run(config.trainer, config.actor_rollout_ref.actor.ulysses_sequence_parallel_size, config.actor_rollout_ref.nccl_timeout)
    claim_run_directory(config.trainer, parallel)
    check_rl_layout(config, parallel.dp_size, parallel.world_size,
                    int(os.environ.get("LOCAL_WORLD_SIZE", parallel.world_size)) if parallel.device.type == "cpu" else 0)
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    tools = load_tools(multi_turn.tool_config_path) if multi_turn.enable and multi_turn.tool_config_path else {}
    interactions = load_interactions(multi_turn.interaction_config_path) if multi_turn.enable and multi_turn.interaction_config_path else {}
    model_config, trainer = config.actor_rollout_ref.model, config.trainer
    hf_config = load_model_config(model_config.path, "actor_rollout_ref.model.path", model_config, parallel.sp_size)
    tokenizer = load_tokenizer(model_config.path, "actor_rollout_ref.model.path", model_config)
    if config.sequence_length > getattr(hf_config, "max_position_embeddings", config.sequence_length):
        raise ConfigError(f"data.max_prompt_length + data.max_response_length = {config.sequence_length} exceeds the model's "
                          f"max_position_embeddings ({hf_config.max_position_embeddings})")
    reward_fn = build_reward_function(config)
    train, val = (load_rl_prompts(config, files, tokenizer, key, tools, interactions)
                  for files, key in ((config.data.train_files, "data.train_files"), (config.data.val_files, "data.val_files")))
    total_steps = count_steps(trainer, len(train), config.data.train_batch_size, "prompts")
    kl_ctrl = build_kl_controller(config)
    algorithm = config.algorithm
    shaping = RewardShaping(algorithm.reward_norm, algorithm.reward_norm_minus_mean, algorithm.reward_clip, config.actor_rollout_ref.rollout.n,
                            RunningMoments())
    cursor = PromptCursor()
    critic = build_critic(config, parallel, total_steps, len(tokenizer), tokenizer.pad_token_id) if config.uses_critic else None
    states = {"prompts": cursor, **({"kl_ctrl": kl_ctrl} if kl_ctrl is not None else {})}
    if critic is not None:
        states["critic_scheduler"] = critic.scheduler
    if algorithm.reward_norm == "running":
        states["reward_norm"] = shaping
    run = open_run(parallel, trainer, model_config.path, model_config, config.actor_rollout_ref.actor.fsdp_config,
                   config.actor_rollout_ref.actor.optim, hf_config, tokenizer, packed=model_config.use_remove_padding, total_steps=total_steps,
                   run_config=asdict(config), states=states, companions={"critic": (critic.model, critic.optimizer)} if critic is not None else None,
                   lora=model_config.lora("actor_rollout_ref.model"))
    scorer = Scorer(reward_fn, tokenizer, config.actor_rollout_ref.rollout.n, overlong_buffer(config), batch_sources(config, parallel, tokenizer))
    step_once = build_step(config, run, hf_config, train, scorer, cursor, kl_ctrl, shaping, critic, tokenizer.pad_token_id)
    engine = step_once.engine
    if multi_turn.enable:
        step_once.sampler.agent = build_agent(config, engine, tokenizer, tools, interactions)
    step_once.sync_weights()  # the resumed weights, before the first rollout
    val_kwargs, rollout = config.actor_rollout_ref.rollout.val_kwargs, config.actor_rollout_ref.rollout

    def validate() -> dict[str, float]:
        return validate_on_ranks(engine, val, reward_fn, tokenizer, val_kwargs.n, val_kwargs.temperature if val_kwargs.do_sample else 0.0,
                                 config.data.max_response_length, rollout.log_prob_micro_batch_size_per_gpu, parallel, step_once.sampler.agent)

    if val and trainer.val_before_train and run.step == 0:
        run.logger.log(validate(), 0)
    history = []  # this process's steps, for the plots
    with lost_ranks_named(run, config.actor_rollout_ref.nccl_timeout, "actor_rollout_ref.nccl_timeout"):
        for step in range(run.step + 1, total_steps + 1):
            timer = StepTimer(step)
            with profile_step(step == trainer.profile_step, step, trainer.default_local_dir, parallel.rank):
                result = step_once(timer)
            if val and run.due(step, trainer.test_freq):
                with timer("testing"):
                    result.metrics.update(validate())
            metrics = record_step(step, result, timer, history, config, run)
            run.end_step(step, metrics, score=f"{metrics['critic/score/mean']:.3f}", length=f"{metrics['response_length/mean']:.0f}")
    run.finish(shutdown=engine.shutdown)


def record_step(step: int, result: StepResult, timer: StepTimer, history: list[dict], config: GRPOConfig, run: Run) -> dict[str, float]:
    """The step's metrics completed (timings, throughput, memory; added to `history`), its rollouts dumped at
    trainer.rollout_data_dir, and the plots drawn at trainer.plot_freq."""
    parallel, trainer, metrics, groups = run.parallel, config.trainer, result.metrics, result.groups
    if config.actor_rollout_ref.actor.use_kl_loss:
        metrics["actor/kl_coef"] = config.actor_rollout_ref.actor.kl_loss_coef
    timer.seconds["step"] = timer.elapsed()
    metrics.update({f"timing_s/{k}": max_over_ranks(v, parallel.device) for k, v in timer.seconds.items()})
    metrics["perf/throughput"] = metrics.pop("perf/tokens") / parallel.world_size / timer.seconds["step"]
    metrics["perf/max_memory_gb"] = max_over_ranks(peak_memory_gb(parallel.device), parallel.device)
    if trainer.rollout_data_dir:
        scored = [s for g in groups for s in g.scored]
        generations = [generation for g in groups for generation in g.generations]
        dump_rollouts(trainer.rollout_data_dir, step, [g.prompt for g in groups], scored, generations, result.response_advantages,
                      config.actor_rollout_ref.rollout.n, parallel)
    history.append({"step": step, **metrics})
    if run.due(step, trainer.plot_freq):
        lengths = [generation.generated_tokens for g in groups for generation in g.generations]
        plot(history, lengths, os.path.join(trainer.default_local_dir, "plots"), run.logger, parallel, step)
    return metrics


def build_reward_function(config: GRPOConfig) -> RewardFn:
    """The per-response reward: reward.sources weighted, else the custom (or built-in) function; none where a reward
    model or server scores alone."""
    if config.reward.sources:
        return weighted_sources(load_reward_sources(config.reward.sources))
    if (config.reward_model.enable or config.reward_model.remote_rm_url) and not config.custom_reward_function.path:
        return no_reward
    return load_reward_function(config.custom_reward_function.path, config.custom_reward_function.name)


def load_rl_prompts(config: GRPOConfig, files: list[str], tokenizer, key: str, tools: dict[str, BaseTool],
                    interactions: dict[str, BaseInteraction]) -> list:
    """The prompts of `files` (data.train_files or data.val_files, named by `key`), rendered with the schemas of
    multi-turn `tools`, their rows' interactions checked, fitted to data.max_prompt_length."""
    if not files:
        return []
    data = config.data
    prompts = load_prompts(files, tokenizer, data.apply_chat_template_kwargs, tool_schemas(tools))
    check_interaction_names(prompts, interactions, key)
    return fit_prompts(prompts, data.max_prompt_length, data.truncation, data.filter_overlong_prompts, key)


def build_agent(config: GRPOConfig, engine: RolloutEngine, tokenizer, tools: dict[str, BaseTool],
                interactions: dict[str, BaseInteraction]) -> AgentLoop:
    """The multi-turn loop on `engine` (actor_rollout_ref.rollout.multi_turn)."""
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    settings = MultiTurnSettings(multi_turn.max_assistant_turns, multi_turn.max_user_turns, multi_turn.max_parallel_calls,
                                 multi_turn.max_tool_response_length, multi_turn.tool_response_truncate_side, multi_turn.format,
                                 multi_turn.tokenization_sanity_check_mode, multi_turn.tool_timeout_s)
    return AgentLoop(engine, tokenizer, settings, tools, interactions, config.data.apply_chat_template_kwargs)


def build_kl_controller(config: GRPOConfig) -> core_algos.KLController | None:
    algorithm = config.algorithm
    if not algorithm.use_kl_in_reward:
        return None
    return core_algos.KLController(algorithm.kl_ctrl.type, algorithm.kl_ctrl.kl_coef, algorithm.kl_ctrl.target_kl, algorithm.kl_ctrl.horizon)


def overlong_buffer(config: GRPOConfig) -> OverlongBuffer | None:
    overlong = config.reward_model.overlong_buffer
    return OverlongBuffer(config.data.max_response_length, overlong.len, overlong.penalty_factor) if overlong.enable else None


def build_engine(config: GRPOConfig, parallel: Parallel, pad_id: int) -> RolloutEngine:
    """The rollout engine that `rollout.name` names, in the actor's compute dtype."""
    model, rollout = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout
    dtype = compute_dtype(config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype, parallel.device)
    vllm = EngineSettings(rollout.gpu_memory_utilization, rollout.max_num_seqs, rollout.max_num_batched_tokens, rollout.enable_chunked_prefill,
                          rollout.enforce_eager, rollout.load_format)
    seed = config.trainer.seed + engine_index(parallel.rank, rollout.tensor_model_parallel_size)
    spec = EngineSpec(model.path, dtype, parallel.device, pad_id, model.trust_remote_code, config.sequence_length, seed,
                      rollout.tensor_model_parallel_size, rollout.free_cache_engine, vllm)
    return build_rollout(rollout.name, spec)


def forward_settings(config: GRPOConfig, pad_id: int) -> ForwardSettings:
    model = config.actor_rollout_ref.model
    return ForwardSettings(model.use_remove_padding, model.share_prompts, model.chunked_loss_tokens, config.actor_rollout_ref.rollout.temperature,
                           pad_id)


def loss_settings(config: GRPOConfig) -> LossSettings:
    actor = config.actor_rollout_ref.actor
    return LossSettings(actor.policy_loss.loss_mode, actor.loss_agg_mode,
                        actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio,
                        actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio, actor.clip_ratio_c,
                        actor.entropy_coeff, actor.kl_loss_coef if actor.use_kl_loss else None, actor.kl_loss_type, actor.loss_scale_factor,
                        config.data.max_response_length, actor.skip_zero_advantage)


def batch_sources(config: GRPOConfig, parallel: Parallel, tokenizer) -> list[BatchSource]:
    """The reward model and the remote reward server, where configured."""
    settings, sources = config.reward_model, []
    if settings.enable:
        sources.append(BatchSource("reward_model", settings.weight, build_reward_model(config, parallel, tokenizer)))
    if settings.remote_rm_url:
        remote = settings.remote
        sources.append(BatchSource("remote", remote.weight, RemoteReward(settings.remote_rm_url, tokenizer, remote.batch_size, remote.max_concurrency,
                                                                          remote.timeout_s, remote.retries, remote.backoff_s)))
    return sources


def build_reward_model(config: GRPOConfig, parallel: Parallel, policy_tokenizer) -> RewardModel:
    """reward_model.*: the sequence-classification checkpoint as a frozen, sharded token-classification model."""
    settings, trainer = config.reward_model, config.trainer
    model_config = ModelConfig(settings.model.trust_remote_code, enable_gradient_checkpointing=False,
                               attn_implementation=config.actor_rollout_ref.model.attn_implementation)
    hf_config = load_model_config(settings.model.path, "reward_model.model.path", model_config, sp_size=1)
    if hf_config.num_labels != 1:
        raise ConfigError(f"reward_model.model.path={settings.model.path!r} has {hf_config.num_labels} labels: a reward model has one")
    tokenizer = load_tokenizer(settings.model.path, "reward_model.model.path", model_config)
    actor_fsdp = config.actor_rollout_ref.actor.fsdp_config
    fsdp = type(actor_fsdp)(**{**vars(actor_fsdp), "cpu_offload": settings.model.fsdp_config.param_offload})
    model = build_sharded_model(settings.model.path, model_config, fsdp, hf_config, trainer, parallel, settings.model.use_remove_padding,
                                trainable=False, auto_class=AutoModelForTokenClassification)
    batching = MicroBatching(settings.micro_batch_size_per_gpu, False, None, "reward_model.micro_batch_size_per_gpu", "", "")
    return RewardModel(model, parallel, batching, settings.model.use_remove_padding, tokenizer.pad_token_id, policy_tokenizer,
                       None if same_tokenizer(tokenizer, policy_tokenizer) else tokenizer)


def build_critic(config: GRPOConfig, parallel: Parallel, total_steps: int, vocabulary: int, pad_id: int) -> Critic:
    """PPO's critic (critic.*): the backbone of critic.model.path with a value head, sharded and trained with
    its own optimizer and LR schedule."""
    critic, trainer = config.critic, config.trainer
    hf_config = load_model_config(critic.model.path, "critic.model.path", critic.model, parallel.sp_size)
    if hf_config.vocab_size < vocabulary:
        raise ConfigError(f"critic.model.path={critic.model.path!r} has {hf_config.vocab_size} token embeddings, fewer than the "
                          f"{vocabulary} tokens of the actor's tokenizer, whose token ids it reads")
    hf_config.num_labels, hf_config.classifier_dropout = 1, 0.0  # one value per token, and no dropout on it, as verl's critic
    model = build_sharded_model(critic.model.path, critic.model, critic.model.fsdp_config, hf_config, trainer, parallel,
                                critic.model.use_remove_padding, trainable=True, auto_class=AutoModelForTokenClassification)
    model.train()
    optimizer = build_optimizer(model, critic.optim)
    forward = ForwardSettings(critic.model.use_remove_padding, critic.model.share_prompts, chunked_loss_tokens=0, temperature=1.0, pad_id=pad_id)
    loss = ValueLossSettings(critic.cliprange_value, critic.loss_agg_mode, config.actor_rollout_ref.actor.loss_scale_factor,
                             config.data.max_response_length)
    update = UpdateSettings(critic.ppo_epochs, critic.ppo_mini_batch_size // parallel.dp_size * config.actor_rollout_ref.rollout.n,
                            critic.shuffle, trainer.seed, critic.grad_clip)
    return Critic(model, optimizer, build_scheduler(optimizer, critic.optim, total_steps), parallel, forward, loss, update,
                  config.critic_batching(forward=False), config.critic_batching(forward=True))


def build_step(config: GRPOConfig, run: Run, hf_config, train: list, scorer: Scorer, cursor: PromptCursor,
               kl_ctrl: core_algos.KLController | None, shaping: RewardShaping, critic: Critic | None, pad_id: int) -> GRPOStep:
    """The step's parts, built with their settings resolved from the config: the actor on the run's model, the
    reference, the rollout engine (without weights until the first sync) and the sampler that drives it; the
    critic comes built (its checkpoint was resumed with the run's)."""
    parallel, trainer = run.parallel, config.trainer
    model, actor, rollout, ref = (config.actor_rollout_ref.model, config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout,
                                  config.actor_rollout_ref.ref)
    algorithm = config.algorithm
    update = UpdateSettings(actor.ppo_epochs, actor.ppo_mini_batch_size // parallel.dp_size * rollout.n, actor.shuffle, trainer.seed,
                            actor.grad_clip)
    log_prob_batching = config.micro_batching(rollout.log_prob_micro_batch_size_per_gpu, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")
    policy = PolicyActor(run.model, run.optimizer, run.scheduler, parallel, forward_settings(config, pad_id), loss_settings(config), update,
                         config.update_batching, log_prob_batching)
    reference = None
    if (actor.use_kl_loss or kl_ctrl is not None) and has_adapters(run.model):
        reference = run.model  # the policy with its adapters switched off: no second model
    elif actor.use_kl_loss or kl_ctrl is not None:
        ref_fsdp = type(actor.fsdp_config)(**{**vars(actor.fsdp_config), "cpu_offload": ref.fsdp_config.param_offload})
        reference = build_sharded_model(model.path, model, ref_fsdp, hf_config, trainer, parallel, model.use_remove_padding, trainable=False)
    engine = build_engine(config, parallel, pad_id)
    agreement = rollout.calculate_log_probs or rollout.name == "vllm" or algorithm.rollout_correction.rollout_is is not None
    request = RolloutRequest(rollout.n, config.data.max_response_length, rollout.log_prob_micro_batch_size_per_gpu, rollout.temperature,
                             rollout.top_p, rollout.top_k, rollout.do_sample, calculate_log_probs=agreement)
    filter_groups = algorithm.filter_groups
    sampler = GroupSampler(train, config.data.train_batch_size, config.data.shuffle, trainer.seed, engine,
                           engine_index(parallel.rank, rollout.tensor_model_parallel_size), request, scorer, parallel,
                           filter_groups.metric if filter_groups.enable else None, filter_groups.max_num_gen_batches, cursor,
                           score_later=config.reward_model.launch_reward_fn_async)
    one_pass = (actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == config.data.train_batch_size and kl_ctrl is None
                and algorithm.rollout_correction.rollout_is is None)
    ref_batching = config.micro_batching(ref.log_prob_micro_batch_size_per_gpu, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")
    return GRPOStep(config, policy, reference, ref_batching, engine, sampler, critic, kl_ctrl, shaping, one_pass, agreement)
