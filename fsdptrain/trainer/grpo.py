"""GRPO-family training, and PPO with a critic, on the shared set-up. A step: draw and score groups of responses,
old and reference log-probs, the critic's values (PPO), rewards and advantages, the critic's update (PPO), the
clipped policy update over mini-batches, the new weights to the rollout engine. Each line of `GRPOStep.__call__`
is a call into one of the rl/ components, which this file builds from the plan (trainer/grpo_plan.py) once.

Each data-parallel rank generates for whole prompts (train_batch_size / dp of them, `rollout.n` responses each),
so a prompt's group of responses sits on one rank (the ranks of a Ulysses group share theirs and each trains on a
slice of every sequence). Batch-wide statistics (REINFORCE++ whitening, the mini-batch's token and sequence counts
that every loss divides by, the metrics) are summed over the data-parallel group, which holds each sample once.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import AutoModelForTokenClassification, PretrainedConfig, PreTrainedTokenizerBase

from fsdptrain.config.grpo import GRPOTrainerConfig, KLControlConfig, RLDataConfig
from fsdptrain.data.dataset import Sample, check_files_exist
from fsdptrain.data.images import ImageReader, check_reads_images_alike, image_reader
from fsdptrain.data.micro_batches import MicroBatching
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.offload import PhaseOffload
from fsdptrain.distributed.reductions import all_reduce_sum, max_over_ranks
from fsdptrain.errors import ConfigError
from fsdptrain.logging.profiler import profile_step
from fsdptrain.models.added_tokens import AddedTokens, add_model_tokens
from fsdptrain.models.architecture import read_architecture
from fsdptrain.models.loading import load_model_config, load_tokenizer
from fsdptrain.models.lora import adapters_disabled
from fsdptrain.optim import build_optimizer, build_scheduler
from fsdptrain.rl import core_algos
from fsdptrain.rl.actor import PolicyActor, compute_log_probs
from fsdptrain.rl.advantages import advantages_and_returns, outcome_rewards, penalize_kl, put_token_values
from fsdptrain.rl.agent.interactions import BaseInteraction, check_interaction_names, load_interactions
from fsdptrain.rl.agent.loop import AGENT_LOOPS, Loop, LoopContext
from fsdptrain.rl.agent.tools import BaseTool, load_tools, tool_schemas
from fsdptrain.rl.critic import Critic
from fsdptrain.rl.data import Prompt, load_prompts
from fsdptrain.rl.metrics import critic_metrics, dump_rollouts, global_stats, multi_turn_metrics, plot, source_metrics, step_metrics
from fsdptrain.rl.reference_sync import mix_policy_into_reference
from fsdptrain.rl.remote_reward import RemoteReward
from fsdptrain.rl.reward_model import RewardModel, same_tokenizer
from fsdptrain.rl.reward_shaping import RewardShaping, RunningMoments, clip_advantages
from fsdptrain.rl.rewards import (
    SOURCE,
    BatchSource,
    RewardFn,
    Scorer,
    entry_sources,
    load_reward_function,
    load_reward_sources,
    no_reward,
    weighted_sources,
    with_extra_info,
)
from fsdptrain.rl.rollout import build_rollout, engine_index, sync_weights
from fsdptrain.rl.rollout.base import ROLLOUT_ENGINES, Generation, RolloutEngine
from fsdptrain.rl.rollout.engine_process import EngineProcess
from fsdptrain.rl.rollout.in_flight import ResponsePool
from fsdptrain.rl.rollout.remote import RemoteRollout, RolloutServer
from fsdptrain.rl.rollout_correction import rollout_agreement
from fsdptrain.rl.samples import make_samples
from fsdptrain.rl.sampling import Group, GroupSampler, PromptCursor, fit_prompts, flatten, local_answers
from fsdptrain.rl.teacher import Teacher
from fsdptrain.rl.validation import validate_on_ranks
from fsdptrain.trainer.grpo_plan import GRPOPlan, RewardModelPlan, RewardPlan, TeacherPlan, fit_to_architecture
from fsdptrain.trainer.runtime import memory_held_gb, peak_memory_gb
from fsdptrain.trainer.setup import (
    ModelSpec,
    Run,
    StepTimer,
    build_sharded_model,
    claim_run_directory,
    count_steps,
    end_run,
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

    plan: GRPOPlan
    actor: PolicyActor
    reference: nn.Module | None  # with the KL loss or the KL in the reward; with LoRA, the actor's model (adapters off)
    engine: RolloutEngine | None  # None: standalone rollout ranks generate (the sampler's `remote`)
    sampler: GroupSampler
    critic: Critic | None  # PPO's (a critic estimator)
    teacher: Teacher | None  # on-policy distillation's
    kl_ctrl: core_algos.KLController | None  # the KL in the reward
    shaping: RewardShaping  # reward normalization and clipping
    # verl's param_offload / optimizer_offload: what leaves the device while the rollouts are generated (and the
    # reference between its forwards); every part is back on the device by the step's end
    actor_offload: PhaseOffload
    reference_offload: PhaseOffload | None  # with a reference
    critic_offload: PhaseOffload | None  # with a critic

    def __call__(self, timer: StepTimer) -> StepResult:
        plan, parallel, advantage = self.plan, self.actor.parallel, self.plan.advantage
        groups, metrics = self.generate(timer)
        generations, ids = flatten(groups)
        group_ids = torch.tensor(ids)
        greedy_scores = None
        if plan.greedy_baseline:
            with timer("gen_max"):
                greedy_scores = torch.tensor(self.sampler.greedy_scores(groups))[group_ids]
        samples = make_samples(generations, plan.mask_truncated_completions)
        self.actor_offload.params_back()
        old_metrics, trained = self.old_log_probs(samples, generations, timer)
        metrics.update(old_metrics)
        self.frozen_models_score(samples, timer)
        if self.critic is not None:
            with timer("values"):
                self.critic_offload.params_back()
                self.critic.values(samples)
        with timer("reward"):
            self.sampler.wait_for_scores(groups)
            scored = [s for g in groups for s in g.scored]
            scores = torch.tensor([s["seq_reward"] for s in scored])
            metrics.update(source_metrics(scored, parallel))
            rewards, shaping_metrics = self.shaping(scores, group_ids, parallel)
            metrics.update(shaping_metrics)
            token_rewards = outcome_rewards(rewards, generations)
            if self.kl_ctrl is not None:
                metrics.update(penalize_kl(token_rewards, samples, generations, self.kl_ctrl, advantage.kl_penalty, parallel))
        with timer("adv"):
            advantages = self.advantages(token_rewards, samples, trained, group_ids, scored, greedy_scores)
            if advantage.clip is not None:
                metrics.update(clip_advantages(advantages, trained, advantage.clip, parallel))
            put_token_values(samples, trained, advantages, "advantage")
            if plan.loss.sft_coef:
                put_token_values(samples, trained, [g.mask * float(s["acc"] > 0) for g, s in zip(trained, scored)], "sft")
        if self.critic is not None:
            with timer("update_critic"):
                self.critic_offload.optimizer_back()
                metrics.update(critic_metrics(samples, generations, parallel))
                metrics.update(self.critic.update(samples))
        self.actor_offload.optimizer_back()
        if timer.step > plan.critic_warmup:
            with timer("update_actor"):
                metrics.update(self.actor.update(samples, first_pass_is_old=plan.one_pass))
            if plan.agreement and plan.one_pass:  # the old log-probs came from the update's forward, of the samples it forwarded
                forwarded = [i for i, sample in enumerate(samples) if "old_log_prob" in sample.token_values]
                metrics.update(rollout_agreement([samples[i] for i in forwarded], [generations[i] for i in forwarded], plan.correction,
                                                 parallel)[0])
            with timer("update_weights"):
                self.sync_weights(timer.step)
        if plan.reference_sync is not None and plan.reference_sync.due(timer.step):
            with timer("sync_ref"):
                mix_policy_into_reference(self.reference, self.actor.model, plan.reference_sync.alpha)
        response_advantages = [float(a[g.mask > 0].mean()) for a, g in zip(advantages, generations)]
        prompts = [g.prompt for g in groups]
        metrics.update(step_metrics(prompts, generations, group_ids, scores, token_rewards, response_advantages, parallel))
        if plan.multi_turn is not None:
            metrics.update(multi_turn_metrics(generations, parallel))
        return StepResult(groups, response_advantages, metrics)

    def generate(self, timer: StepTimer) -> tuple[list, dict[str, float]]:
        """The step's groups and the sampler's metrics (with standalone rollout ranks, the groups' lag behind the
        policy and the share of responses drawn by two versions or more); the actor's and critic's offloaded parts
        wait in host memory."""
        with timer("gen"):
            self.actor_offload.leave()
            if self.critic_offload is not None:
                self.critic_offload.leave()
            held = memory_held_gb(self.actor.parallel.device)
            groups, metrics = self.sampler.next_groups()
        if self.sampler.remote is not None or self.sampler.pool is not None:  # the policy that trains on them is version step - 1
            parallel = self.actor.parallel
            metrics.update(global_stats("async/staleness", [float(timer.step - 1 - g.policy_version) for g in groups], parallel))
            partial, responses = all_reduce_sum([sum(len(set(r.versions or [])) > 1 for g in groups for r in g.generations),
                                                 sum(len(g.generations) for g in groups)], parallel.device, parallel.dp_group)
            metrics["async/partial_responses"] = partial / max(responses, 1.0)
        if held is not None:
            metrics["perf/memory_at_gen_gb"] = max_over_ranks(held, self.actor.parallel.device, self.actor.parallel.group)
        return groups, metrics

    def frozen_models_score(self, samples: list[Sample], timer: StepTimer) -> None:
        """The reference's log-probs of the samples (for a KL), and the teacher's token values (distillation)."""
        if self.reference is not None:
            with timer("ref"), adapters_disabled(self.reference):
                self.reference_offload.params_back()
                compute_log_probs(self.reference, samples, self.plan.ref_batching, self.actor.forward, self.actor.parallel, "ref_log_prob")
                self.reference_offload.leave()
        if self.teacher is not None:
            with timer("teacher"):
                self.teacher.score(samples, self.actor.forward, self.actor.parallel)

    def old_log_probs(self, samples: list[Sample], generations: list[Generation], timer: StepTimer) -> tuple[dict[str, float], list[Generation]]:
        """The old policy's log-probs on the samples: the engine's (bypass), or a pass of their own, with the
        engine's agreement metrics and the rollout correction applied (rollout_agreement); none with one_pass (the
        update's first forward computes them). Returns the metrics and the generations as the advantages see them."""
        plan = self.plan
        if plan.old_from_rollout:
            for sample in samples:
                sample.token_values["old_log_prob"] = sample.token_values["rollout_log_prob"]
        elif not plan.one_pass:
            with timer("old_log_prob"):
                self.actor.log_probs(samples, "old_log_prob", with_sum_pi_squared=plan.sum_pi_squared)
            if plan.agreement:
                return rollout_agreement(samples, generations, plan.correction, self.actor.parallel)
        return {}, generations

    def advantages(self, token_rewards: list[torch.Tensor], samples: list[Sample], generations: list[Generation], group_ids: torch.Tensor,
                   scored: list[dict], greedy_scores: torch.Tensor | None) -> list[torch.Tensor]:
        """Each response's per-token advantages by the plan's estimator; under PPO, the critic's returns are put
        on the samples."""
        advantage = self.plan.advantage
        source_scores = None
        if advantage.sources:
            source_scores = torch.tensor([[s[f"{SOURCE}{name}"] for name, _ in advantage.sources] for s in scored])
        advantages, returns = advantages_and_returns(token_rewards, samples, generations, group_ids, advantage, self.actor.parallel,
                                                     source_scores, greedy_scores)
        if self.critic is not None:
            put_token_values(samples, generations, returns, "returns")
        return advantages

    def sync_weights(self, version: int) -> None:
        """The policy after `version` updates to the engine, or to the standalone rollout ranks."""
        if self.sampler.remote is not None:
            self.sampler.remote.send_weights(self.actor.model, self.plan.engine.dtype, self.plan.weight_bucket_bytes, version)
            return
        self.engine.wake_up()  # the weights go to the engine's own memory, not to what it parks while asleep
        sync_weights(self.actor.model, self.engine, self.plan.weight_bucket_bytes)
        if self.sampler.pool is not None:
            self.sampler.pool.version = version


@dataclass
class GRPOInputs:
    """What a GRPO run reads before its processes work together: each is checked, and a problem is the user's
    before any rank has started (fsdptrain.check reads the same)."""

    plan: GRPOPlan
    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    reward_fn: RewardFn
    train: list[Prompt]
    val: list[Prompt]
    total_steps: int
    added: AddedTokens | None  # actor_rollout_ref.model.added_tokens_file's
    critic_config: PretrainedConfig | None  # critic.model.path's, with its value head (PPO)
    reward_config: PretrainedConfig | None  # reward_model.model.path's (reward_model.enable)
    teacher_config: PretrainedConfig | None  # distillation.teacher_models.teacher_model.model_path's (distillation.enabled)
    loops: dict[str, Loop]  # the agent loops the rows name, built (and so checked) before the engine they are given exists


def read_grpo_inputs(plan: GRPOPlan, tokenizer: PreTrainedTokenizerBase) -> GRPOInputs:
    """What the plan names, read with the policy's `tokenizer` (resolve_grpo's)."""
    spec, data = plan.actor_model, plan.data
    check_files_exist({"data.train_files": data.train_files, "data.val_files": data.val_files})
    tools = load_tools(plan.tools_file) if plan.tools_file else {}
    interactions = load_interactions(plan.interactions_file) if plan.interactions_file else {}
    hf_config = load_model_config(spec.path, "actor_rollout_ref.model.path", spec.model, plan.sp_size)
    critic_config = critic_model_config(plan.critic_model, len(tokenizer), plan.sp_size) if plan.critic_model is not None else None
    plan = fit_to_architecture(plan, read_architecture(hf_config), read_architecture(critic_config) if critic_config is not None else None)
    added = add_model_tokens(spec.model, "actor_rollout_ref.model", tokenizer, hf_config)
    if added is not None and hf_config.get_text_config().vocab_size > added.pretrained_rows:
        raise ConfigError(f"actor_rollout_ref.model.added_tokens_file: {len(added.new_ids)} tokens are new to "
                          f"actor_rollout_ref.model.path={spec.path!r}, past its {added.pretrained_rows} embedding rows, and its "
                          "rollout engine loads the folder as it is: add them by SFT (model.added_tokens_file) and train GRPO from "
                          "its export, whose tokenizer and embedding hold them")
    if plan.sequence_length > getattr(hf_config, "max_position_embeddings", plan.sequence_length):
        raise ConfigError(f"data.max_prompt_length + data.max_response_length = {plan.sequence_length} exceeds the model's "
                          f"max_position_embeddings ({hf_config.max_position_embeddings})")
    reward_fn = build_reward_function(plan.reward)
    images = image_reader(spec.path, "actor_rollout_ref.model.path", data.image_key, tokenizer, hf_config, spec.model.trust_remote_code)
    train, val = (load_rl_prompts(data, plan.default_agent_loop, files, tokenizer, key, tools, interactions, images)
                  for files, key in ((data.train_files, "data.train_files"), (data.val_files, "data.val_files")))
    total_steps = count_steps(plan.trainer, len(train), data.train_batch_size, "prompts")
    loops = build_loops(LoopContext(None, tokenizer, plan.multi_turn, tools, interactions, data.apply_chat_template_kwargs, images), [*train, *val])
    reward_config = reward_model_config(plan.reward.model.spec) if plan.reward.model is not None else None
    with_images = images if any(prompt.images is not None for prompt in [*train, *val]) else None
    check_companions_read_images(plan, with_images, hf_config.model_type, tokenizer, critic_config, reward_config)
    teacher_config = teacher_model_config(plan.teacher.spec, tokenizer, plan.sp_size, with_images, hf_config.model_type) if plan.teacher is not None else None
    return GRPOInputs(plan, tokenizer, hf_config, reward_fn, train, val, total_steps, added, critic_config=critic_config, reward_config=reward_config,
                      teacher_config=teacher_config, loops=loops)


def run_grpo(plan: GRPOPlan, tokenizer: PreTrainedTokenizerBase) -> None:
    inputs = read_grpo_inputs(plan, tokenizer)
    tokenizer, hf_config, train, val, total_steps, trainer = (inputs.tokenizer, inputs.hf_config, inputs.train, inputs.val, inputs.total_steps,
                                                              plan.trainer)
    parallel = start_run(trainer, plan.sp_size, plan.nccl_timeout, plan.rollout_ranks)
    if parallel.generates_only:
        serve_as_rollout_rank(plan, inputs, parallel)
        return
    claim_run_directory(trainer, parallel)
    kl_ctrl = build_kl_controller(plan.kl_control)
    shaping = RewardShaping(plan.shaping, RunningMoments())
    cursor = PromptCursor()
    pool = (ResponsePool(parallel, plan.request.n, plan.asynchronous.lead, plan.asynchronous.max_lag, plan.asynchronous.wait)
            if plan.asynchronous is not None and not plan.rollout_ranks else None)
    critic = build_critic(plan, parallel, total_steps, inputs.critic_config) if plan.critic is not None else None
    states = {"prompts": cursor, **({"kl_ctrl": kl_ctrl} if kl_ctrl is not None else {}), **({"in_flight": pool} if pool is not None else {})}
    if critic is not None:
        states["critic_scheduler"] = critic.scheduler
    if plan.shaping.norm == "running":
        states["reward_norm"] = shaping
    reference = build_reference(plan, parallel, hf_config, inputs.added)
    teacher = build_teacher(plan, parallel, inputs.teacher_config) if plan.teacher is not None else None
    companions = {}
    if critic is not None:
        companions["critic"] = (critic.model, critic.optimizer)
    if plan.reference_sync is not None:  # the reference moves: saved and resumed with the run
        companions["reference"] = (reference, None)
    run = open_run(parallel, trainer, plan.actor_model, hf_config, tokenizer, total_steps=total_steps, run_config=plan.run_config, states=states,
                   companions=companions, added=inputs.added)
    scorer = Scorer(inputs.reward_fn, tokenizer, plan.overlong, batch_sources(plan.reward, plan, parallel, tokenizer, inputs.reward_config))
    step_once = build_step(plan, run, reference, train, scorer, cursor, kl_ctrl, shaping, critic, pool, teacher)
    engine, sampler = step_once.engine, step_once.sampler
    if engine is not None:
        for loop in inputs.loops.values():
            loop.engine = engine
        sampler.answer = local_answers(engine, inputs.loops)
    step_once.sync_weights(run.step)  # the resumed weights, before the first rollout
    # Validation is scored as training is (the same sources, reward model and server), without the overlong penalty.
    validation_scorer = replace(scorer, overlong=None)

    def validate() -> dict[str, float]:
        score = lambda responses, prompts, ids: validation_scorer(responses, prompts, ids, "validation")  # noqa: E731
        return validate_on_ranks(sampler.answer, val, score, plan.validation, parallel, ranked=plan.ranked_responses)

    if val and trainer.val_before_train and run.step == 0:
        run.logger.log(validate(), 0)
    history = []  # this process's steps, for the plots
    with lost_ranks_named(run, plan.nccl_timeout, "actor_rollout_ref.nccl_timeout"):
        for step in range(run.step + 1, total_steps + 1):
            timer = StepTimer(step)
            with profile_step(step == trainer.profile_step, step, trainer.default_local_dir, parallel.rank):
                result = step_once(timer)
            if val and run.due(step, trainer.test_freq):
                with timer("testing"):
                    result.metrics.update(validate())
            metrics = record_step(step, result, timer, history, plan, run)
            run.end_step(step, metrics, score=f"{metrics['critic/score/mean']:.3f}", length=f"{metrics['response_length/mean']:.0f}")
    run.finish(shutdown=engine.shutdown if engine is not None else sampler.remote.stop)


def serve_as_rollout_rank(plan: GRPOPlan, inputs: GRPOInputs, parallel: Parallel) -> None:
    """A standalone rollout rank's run (separate_async): the agent loops on an engine of its own, always awake,
    answering its training ranks until they stop (rl/rollout/remote.py)."""
    spec = replace(plan.engine, free_cache_engine=False)
    engine = EngineProcess(plan.engine_name, spec) if ROLLOUT_ENGINES.info[plan.engine_name].own_world else build_rollout(plan.engine_name, spec)
    for loop in inputs.loops.values():
        loop.engine = engine
    RolloutServer(engine, local_answers(engine, inputs.loops), parallel).serve()
    end_run(engine.shutdown)


def record_step(step: int, result: StepResult, timer: StepTimer, history: list[dict], plan: GRPOPlan, run: Run) -> dict[str, float]:
    """The step's metrics completed (timings, throughput, memory; added to `history`), its rollouts dumped at
    trainer.rollout_data_dir, and the plots drawn at trainer.plot_freq."""
    parallel, metrics, groups, trainer = run.parallel, result.metrics, result.groups, plan.trainer
    if plan.loss.kl_coef is not None:
        metrics["actor/kl_coef"] = plan.loss.kl_coef
    timer.seconds["step"] = timer.elapsed()
    metrics.update({f"timing_s/{k}": max_over_ranks(v, parallel.device, parallel.group) for k, v in timer.seconds.items()})
    metrics["perf/throughput"] = metrics.pop("perf/tokens") / parallel.world_size / timer.seconds["step"]
    metrics["perf/max_memory_gb"] = max_over_ranks(peak_memory_gb(parallel.device), parallel.device, parallel.group)
    if trainer.rollout_data_dir:
        scored = [s for g in groups for s in g.scored]
        generations, ids = flatten(groups)
        origins = [(g.batch, step - 1 if g.policy_version is None else g.policy_version) for g in groups]
        dump_rollouts(trainer.rollout_data_dir, step, [g.prompt for g in groups], ids, scored, generations, result.response_advantages, parallel,
                      origins)
    history.append({"step": step, **metrics})
    if run.due(step, trainer.plot_freq, last_when_off=True):
        lengths = [generation.generated_tokens for g in groups for generation in g.generations]
        plot(history, lengths, os.path.join(trainer.default_local_dir, "plots"), run.logger, parallel, step)
    return metrics


def build_reward_function(reward: RewardPlan) -> RewardFn:
    """The per-response reward: reward.sources weighted, else the custom (or built-in) function, whole or as the
    entries algorithm.gdpo_reward_keys names; none where a reward model or server scores alone. Each call's
    extra_info gains what the reward manager adds."""
    if reward.sources:
        fn = weighted_sources(load_reward_sources(reward.sources))
    elif reward.entries is not None:
        fn = entry_sources(load_reward_function(reward.function.path, reward.function.name, kwargs=reward.function.reward_kwargs), reward.entries)
    elif (reward.model is not None or reward.remote_url) and not reward.function.path:
        return no_reward
    else:
        fn = load_reward_function(reward.function.path, reward.function.name, kwargs=reward.function.reward_kwargs)
    return with_extra_info(fn, reward.extra_info) if reward.extra_info else fn


def load_rl_prompts(data: RLDataConfig, default_agent_loop: str, files: list[str], tokenizer, key: str, tools: dict[str, BaseTool],
                    interactions: dict[str, BaseInteraction], images: ImageReader | None = None) -> list:
    """The prompts of `files` (data.train_files or data.val_files, named by `key`), rendered with the schemas of
    multi-turn `tools` (with a vision-language model's `images` reader, their images read), their rows'
    interactions and agent loops checked (a row without `agent_name` takes `default_agent_loop`), fitted to
    data.max_prompt_length."""
    if not files:
        return []
    prompts = load_prompts(files, tokenizer, data.apply_chat_template_kwargs, tool_schemas(tools), images)
    check_interaction_names(prompts, interactions, key)
    for row, prompt in enumerate(prompts):
        prompt.agent_name = prompt.agent_name or default_agent_loop
        if prompt.agent_name not in AGENT_LOOPS:
            raise ConfigError(f"{key} row {row}: agent_name={prompt.agent_name!r} is not a registered agent loop "
                              f"({'|'.join(AGENT_LOOPS)})")
        if prompt.images is not None and not AGENT_LOOPS.info[prompt.agent_name].images:
            raise ConfigError(f"{key} row {row}: agent_name={prompt.agent_name!r} with images: only "
                              f"{', '.join(AGENT_LOOPS.names(images=True))} take them")
    return fit_prompts(prompts, data.max_prompt_length, data.truncation, data.filter_overlong_prompts, key)


def build_loops(context: LoopContext, prompts: list) -> dict[str, Loop]:
    """The agent loops that the prompts' `agent_name`s name, in one order on every rank (every rank loads every row)."""
    return {name: AGENT_LOOPS[name](context) for name in sorted({p.agent_name for p in prompts})}


def build_kl_controller(settings: KLControlConfig | None) -> core_algos.KLController | None:
    return None if settings is None else core_algos.KLController(settings.type, settings.kl_coef, settings.target_kl, settings.horizon)


def batch_sources(reward: RewardPlan, plan: GRPOPlan, parallel: Parallel, tokenizer, reward_config: PretrainedConfig | None) -> list[BatchSource]:
    """The reward model (`reward_config`: its folder's config) and the remote reward server, where configured."""
    sources = []
    if reward.model is not None:
        sources.append(BatchSource("reward_model", reward.model.weight, build_reward_model(reward.model, plan.trainer, parallel, tokenizer, reward_config)))
    if reward.remote_url:
        remote = reward.remote
        sources.append(BatchSource("remote", remote.weight, RemoteReward(reward.remote_url, tokenizer, remote.batch_size, remote.max_concurrency,
                                                                          remote.timeout_s, remote.retries, remote.backoff_s)))
    return sources


def reward_model_config(spec: ModelSpec) -> PretrainedConfig:
    """reward_model.model.path's config, checked (a reward model has one label) before any process starts."""
    hf_config = load_model_config(spec.path, "reward_model.model.path", spec.model, sp_size=1)
    if hf_config.num_labels != 1:
        raise ConfigError(f"reward_model.model.path={spec.path!r} has {hf_config.num_labels} labels: a reward model has one")
    return hf_config


def check_companions_read_images(plan: GRPOPlan, images: ImageReader | None, policy_type: str, tokenizer: PreTrainedTokenizerBase,
                                 critic_config: PretrainedConfig | None, reward_config: PretrainedConfig | None) -> None:
    """Where the prompts hold images (`images`: the policy's reader), the critic and the reward model are given them
    as the policy reads them: each must read them alike, and the reward model must share the policy's tokenizer (a
    conversation templated again with another would lose its images)."""
    if images is None:
        return
    if critic_config is not None:
        spec = plan.critic_model
        check_reads_images_alike(images, policy_type, spec.path, critic_config, "critic.model.path", spec.model.trust_remote_code)
    if reward_config is not None:
        spec, key = plan.reward.model.spec, "reward_model.model.path"
        check_reads_images_alike(images, policy_type, spec.path, reward_config, key, spec.model.trust_remote_code)
        if not same_tokenizer(load_tokenizer(spec.path, key, spec.model), tokenizer):
            raise ConfigError(f"{key}={spec.path!r} has another tokenizer or chat template than actor_rollout_ref.model.path: its "
                              "conversations would be templated again with its own, which does not carry the prompts' images; give it the policy's")


def build_reward_model(settings: RewardModelPlan, trainer: GRPOTrainerConfig, parallel: Parallel, policy_tokenizer,
                       hf_config: PretrainedConfig) -> RewardModel:
    """reward_model.*: the sequence-classification checkpoint (`hf_config`: its config) as a frozen, sharded
    token-classification model."""
    spec = settings.spec
    tokenizer = load_tokenizer(spec.path, "reward_model.model.path", spec.model)
    model = build_sharded_model(spec.path, spec.model, spec.fsdp, hf_config, trainer, parallel, spec.packed, trainable=False,
                                auto_class=AutoModelForTokenClassification)
    offload = PhaseOffload(model, None, spec.fsdp.param_offload, False)
    offload.leave()
    batching = MicroBatching(settings.micro_batch_size, False, None, "reward_model.micro_batch_size_per_gpu", "", "")
    return RewardModel(model, parallel, batching, spec.packed, tokenizer.pad_token_id, policy_tokenizer,
                       None if same_tokenizer(tokenizer, policy_tokenizer) else tokenizer, offload)


def critic_model_config(spec: ModelSpec, vocabulary: int, sp_size: int) -> PretrainedConfig:
    """critic.model.path's config with a value head, checked before any process starts: it reads the token ids of
    the actor's tokenizer (`vocabulary` of them)."""
    hf_config = load_model_config(spec.path, "critic.model.path", spec.model, sp_size)
    if hf_config.get_text_config().vocab_size < vocabulary:
        raise ConfigError(f"critic.model.path={spec.path!r} has {hf_config.get_text_config().vocab_size} token embeddings, fewer than the "
                          f"{vocabulary} tokens of the actor's tokenizer, whose token ids it reads")
    hf_config.num_labels, hf_config.classifier_dropout = 1, 0.0  # one value per token, and no dropout on it, as verl's critic
    return hf_config


def build_critic(plan: GRPOPlan, parallel: Parallel, total_steps: int, hf_config: PretrainedConfig) -> Critic:
    """PPO's critic (critic.*): the backbone of critic.model.path (`hf_config`: its config, critic_model_config's)
    with a value head, sharded and trained with its own optimizer and LR schedule."""
    spec, settings = plan.critic_model, plan.critic
    model = build_sharded_model(spec.path, spec.model, spec.fsdp, hf_config, plan.trainer, parallel, spec.packed, trainable=True,
                                auto_class=AutoModelForTokenClassification)
    model.train()
    optimizer = build_optimizer(model, spec.optim)
    return Critic(model, optimizer, build_scheduler(optimizer, spec.optim, total_steps), parallel, settings.forward, settings.loss,
                  settings.update, settings.update_batching, settings.forward_batching)


def teacher_model_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, sp_size: int, images: ImageReader | None,
                         policy_type: str) -> PretrainedConfig:
    """The teacher's config, checked before any process starts: it scores the policy's token ids, so it shares the
    policy's vocabulary (as verl requires of a teacher), and the policy's images (`images`: its reader) as they are."""
    key = "distillation.teacher_models.teacher_model.model_path"
    hf_config = load_model_config(spec.path, key, spec.model, sp_size)
    teacher_tokenizer = load_tokenizer(spec.path, key, spec.model)
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab() or hf_config.get_text_config().vocab_size < len(tokenizer):
        raise ConfigError(f"{key}={spec.path!r} has another vocabulary than actor_rollout_ref.model.path's tokenizer: the teacher "
                          "scores the policy's token ids, so the two must share their tokenizer")
    check_reads_images_alike(images, policy_type, spec.path, hf_config, key, spec.model.trust_remote_code)
    return hf_config


def build_teacher(plan: GRPOPlan, parallel: Parallel, hf_config: PretrainedConfig) -> Teacher:
    """On-policy distillation's teacher (`hf_config`: its config, teacher_model_config's), frozen and sharded by its
    own fsdp_config, in host memory between its forwards where it offloads."""
    spec: TeacherPlan = plan.teacher
    model = build_sharded_model(spec.spec.path, spec.spec.model, spec.spec.fsdp, hf_config, plan.trainer, parallel, spec.spec.packed,
                                trainable=False)
    offload = PhaseOffload(model, None, spec.spec.fsdp.param_offload, False)
    offload.leave()
    return Teacher(model, spec.batching, offload, plan.loss.distillation, read_architecture(hf_config).shares_prompts)


def build_reference(plan: GRPOPlan, parallel: Parallel, hf_config: PretrainedConfig, added: AddedTokens | None) -> nn.Module | None:
    """The frozen reference, sharded by its own fsdp_config (with the `added` tokens' rows the actor starts from), where the
    KL needs one and LoRA does not give it (the actor's own weights, adapters off); built before the run's
    checkpoint is resumed, which holds it when it moves."""
    spec = plan.reference_model
    if spec is None:
        return None
    return build_sharded_model(spec.path, spec.model, spec.fsdp, hf_config, plan.trainer, parallel, spec.packed, trainable=False, added=added)


def answer_encoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[Prompt], list[int]]:
    """A prompt's answer as a response: its ground truth's tokens and the end token (rollout.add_gt)."""
    return lambda prompt: tokenizer(str(prompt.ground_truth), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def build_step(plan: GRPOPlan, run: Run, reference: nn.Module | None, train: list, scorer: Scorer,
               cursor: PromptCursor, kl_ctrl: core_algos.KLController | None, shaping: RewardShaping, critic: Critic | None,
               pool: ResponsePool | None, teacher: Teacher | None) -> GRPOStep:
    """The step's parts, built with the plan's settings: the actor on the run's model, the reference (LoRA's: the
    actor's model), the rollout engine (without weights until the first sync) and the sampler that drives it; the
    critic, a standalone reference, the teacher and colocate_async's pool come built (their states were resumed with the run's)."""
    parallel, trainer = run.parallel, plan.trainer
    policy = PolicyActor(run.model, run.optimizer, run.scheduler, parallel, plan.forward, plan.loss, plan.update, plan.update_batching,
                         plan.log_prob_batching, run.trained_rows)
    actor_fsdp = plan.actor_model.fsdp
    actor_offload = PhaseOffload(run.model, run.optimizer, actor_fsdp.param_offload, actor_fsdp.optimizer_offload)
    reference_offload = None
    if plan.needs_reference and reference is None:  # LoRA's (build_reference builds none)
        reference = run.model  # the policy with its adapters switched off: no second model, on the device as the actor
        reference_offload = PhaseOffload(reference, None, False, False)
    elif reference is not None:
        reference_offload = PhaseOffload(reference, None, plan.reference_model.fsdp.param_offload, False)
        reference_offload.leave()
    critic_offload = None
    if critic is not None:
        critic_fsdp = plan.critic_model.fsdp
        critic_offload = PhaseOffload(critic.model, critic.optimizer, critic_fsdp.param_offload, critic_fsdp.optimizer_offload)
    engine, remote = None, None
    if not plan.rollout_ranks:
        engine = build_rollout(plan.engine_name, plan.engine)
    else:
        remote = RemoteRollout(parallel, plan.asynchronous.lead, plan.asynchronous.max_lag, run.total_steps)
    sampler = GroupSampler(train, plan.data.train_batch_size, plan.data.shuffle, trainer.seed,
                           engine_index(parallel.rank, plan.engine.tensor_parallel_size), plan.request, scorer, parallel, plan.filter_metric,
                           plan.max_gen_batches, cursor, score_later=plan.score_later, answer=remote.answer if remote else None, remote=remote,
                           answer_ids=answer_encoder(scorer.tokenizer) if plan.add_ground_truth else None, pool=pool)
    if pool is not None:
        pool.bind(engine, sampler.batch_prompts)
    return GRPOStep(plan, policy, reference, engine, sampler, critic, teacher, kl_ctrl, shaping, actor_offload, reference_offload, critic_offload)
