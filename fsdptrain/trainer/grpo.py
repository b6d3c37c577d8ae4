"""GRPO-family training on the shared set-up: rollout, score, advantages, old and reference log-probs, the clipped
policy update over mini-batches, and the new weights to the rollout engine.

Each data-parallel rank generates for whole prompts (train_batch_size / dp of them, `rollout.n` responses each),
so a prompt's group of responses sits on one rank (the ranks of a Ulysses group share theirs and each trains on a
slice of every sequence). Batch-wide statistics (REINFORCE++ whitening, the mini-batch's token and sequence counts
that every loss divides by, the metrics) are summed over the data-parallel group, which holds each sample once.
"""

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdptrain.config.schema import DTYPES, ConfigError, GRPOConfig, MicroBatching, check_rl_layout
from fsdptrain.data.batching import epoch_batches
from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import MicroBatch, collate, plan_micro_batches
from fsdptrain.distributed.fsdp import full_parameters
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum, gather_lists, max_over_ranks
from fsdptrain.distributed.ulysses import gather_sequence
from fsdptrain.evaluate import evaluate, summarize
from fsdptrain.logging.plots import write_plots
from fsdptrain.logging.profiler import profile_step
from fsdptrain.models.loading import load_model_config, load_tokenizer
from fsdptrain.models.loss import IGNORE_INDEX, token_log_probs
from fsdptrain.rl import core_algos
from fsdptrain.rl.data import Prompt, load_prompts
from fsdptrain.rl.rewards import RewardFn, load_reward_function, overlong_penalty, score_responses
from fsdptrain.rl.rollout.hf import Generation, HFRollout
from fsdptrain.trainer.optim import clipped_step
from fsdptrain.trainer.runtime import log, peak_memory_gb
from fsdptrain.trainer.setup import Run, build_sharded_model, open_run, start_run

RolloutEngine = Any  # HFRollout or rl.rollout.vllm.VLLMRollout: generate, update_weights, sleep, wake_up, shutdown, dtype


def fit_prompts(prompts: list[Prompt], config: GRPOConfig, source: str) -> list[Prompt]:
    """Prompts within data.max_prompt_length: longer ones dropped (counted) with filter_overlong_prompts, else cut
    by data.truncation (error names the row)."""
    limit, data = config.data.max_prompt_length, config.data
    kept = []
    for row, prompt in enumerate(prompts):
        if len(prompt.ids) <= limit:
            kept.append(prompt)
        elif data.filter_overlong_prompts:
            continue
        elif data.truncation == "error":
            raise ConfigError(f"{source} row {row}: the prompt has {len(prompt.ids)} tokens, over data.max_prompt_length={limit} "
                              "(data.truncation=error, data.filter_overlong_prompts=false)")
        else:
            prompt.ids = prompt.ids[-limit:] if data.truncation == "left" else prompt.ids[:limit]
            kept.append(prompt)
    if len(kept) < len(prompts):
        log.warning("dropped %d of %d prompts of %s over data.max_prompt_length=%d", len(prompts) - len(kept), len(prompts), source, limit)
    if not kept:
        raise ConfigError(f"{source}: no prompt fits data.max_prompt_length={limit}")
    return kept


def score(generations: Sequence[Generation], prompts: Sequence[Prompt], reward_fn: RewardFn, tokenizer, config: GRPOConfig,
          where: str) -> list[dict]:
    """Each response's scores from the reward function; `seq_reward`, what it is trained on, adds DAPO's overlong
    penalty to `score` where that is on."""
    n, overlong = config.actor_rollout_ref.rollout.n, config.reward_model.overlong_buffer
    scores = score_responses(reward_fn, tokenizer, prompts, [g.response_ids for g in generations], n, f"{where}, this rank's ")
    for scored in scores:
        scored["seq_reward"] = scored["score"]
        if overlong.enable:
            scored["overlong_penalty"] = overlong_penalty(scored["response_length"], config.data.max_response_length, overlong.len,
                                                          overlong.penalty_factor)
            scored["seq_reward"] += scored["overlong_penalty"]
    return scores


@dataclass
class Group:
    """One prompt with its `rollout.n` responses and their scores."""

    prompt: Prompt
    generations: list[Generation]
    scored: list[dict]


class PromptCursor:
    """How many batches of prompts the run has drawn: one a step, more with filter_groups. Checkpointed, so that a
    resumed run draws the batches, and samples with the seeds, that an uninterrupted one would."""

    def __init__(self):
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]


def draw_groups(train: Sequence[Prompt], cursor: PromptCursor, rollout: RolloutEngine, reward_fn: RewardFn, tokenizer, config: GRPOConfig,
                parallel: Parallel) -> list[Group]:
    """The next batch of prompts: this data-parallel rank's share, generated and scored. The ranks of a Ulysses
    group generate a part each, then all hold the whole share."""
    data, rollout_config = config.data, config.actor_rollout_ref.rollout
    epoch, index = divmod(cursor.batches, len(train) // data.train_batch_size)
    batch = epoch_batches(len(train), data.train_batch_size, config.trainer.seed, epoch, data.shuffle)[index]
    per_rank = data.train_batch_size // parallel.dp_size
    prompts = [train[i] for i in batch[parallel.dp_rank * per_rank : (parallel.dp_rank + 1) * per_rank][parallel.sp_rank :: parallel.sp_size]]
    # Resumable sampling; the ranks of one tensor-parallel vLLM engine sample as one, from the same seed.
    torch.manual_seed(config.trainer.seed * 1_000_003 + cursor.batches * parallel.world_size + rollout_engine_index(config, parallel))
    cursor.batches += 1
    n = rollout_config.n
    rollout.wake_up()
    generations = rollout.generate([p.ids for p in prompts], n, data.max_response_length, rollout_config.log_prob_micro_batch_size_per_gpu,
                                   temperature=rollout_config.temperature, top_p=rollout_config.top_p, top_k=rollout_config.top_k,
                                   do_sample=rollout_config.do_sample, calculate_log_probs=rollout_log_probs_needed(config))
    rollout.sleep()
    scored = score(generations, prompts, reward_fn, tokenizer, config, f"prompt batch {cursor.batches}")
    groups = [Group(prompt, generations[i * n : (i + 1) * n], scored[i * n : (i + 1) * n]) for i, prompt in enumerate(prompts)]
    return gather_lists(groups, parallel.ulysses_group) if parallel.sp_size > 1 else groups


FILTER_KEYS = {"acc": "acc", "score": "score", "seq_reward": "seq_reward", "seq_final_reward": "seq_reward"}  # no KL in the reward yet


def varied_groups(draw, config: GRPOConfig, parallel: Parallel) -> tuple[list[Group], int]:
    """DAPO's dynamic sampling: draw batches, keeping the groups whose filter metric varies (the others teach
    nothing: every advantage is 0), until train_batch_size of them are kept over all data-parallel ranks; this
    rank's share of the first train_batch_size, and the number of batches drawn."""
    spec, batch_size = config.algorithm.filter_groups, config.data.train_batch_size
    key = FILTER_KEYS[spec.metric]
    kept: list[Group] = []
    rounds = total = 0
    while total < batch_size:
        if rounds == spec.max_num_gen_batches:
            raise RuntimeError(f"algorithm.filter_groups: {int(total)} groups with varying {spec.metric} after max_num_gen_batches="
                               f"{rounds} batches, fewer than data.train_batch_size={batch_size}; raise max_num_gen_batches, or "
                               "use prompts that the policy sometimes solves")
        rounds += 1
        kept += [g for g in draw() if len(g.scored) == 1 or len({s[key] for s in g.scored}) > 1]
        (total,) = all_reduce_sum([len(kept)], parallel.device, parallel.dp_group)
    per_rank = batch_size // parallel.dp_size
    everyone = gather_lists(kept, parallel.dp_group)[:batch_size]
    return everyone[parallel.dp_rank * per_rank : (parallel.dp_rank + 1) * per_rank], rounds


def rollout_log_probs_needed(config: GRPOConfig) -> bool:
    """Whether the engine's sampling log-probs are kept: asked for, needed by the correction, or free (vLLM)."""
    rollout = config.actor_rollout_ref.rollout
    return rollout.calculate_log_probs or rollout.name == "vllm" or config.algorithm.rollout_correction.rollout_is is not None


def make_samples(generations: Sequence[Generation], mask_truncated: bool) -> list[Sample]:
    """Prompt + response as training samples: the loss on the tokens the policy produced (none of a truncated
    response with mask_truncated_completions); each token carries its sequence's index and response token count,
    and where the engine gave them, the sampling log-probs."""
    samples = []
    for i, generation in enumerate(generations):
        response_mask = [0] * len(generation.response_ids) if mask_truncated and generation.truncated else generation.response_mask
        length = len(generation.prompt_ids) + len(generation.response_ids)
        values = {"sequence": torch.full((length,), float(i)), "sequence_tokens": torch.full((length,), float(sum(response_mask)))}
        if generation.log_probs is not None:
            values["rollout_log_prob"] = aligned(generation.log_probs, len(generation.prompt_ids))
        samples.append(Sample(torch.tensor(generation.prompt_ids + generation.response_ids),
                              torch.tensor([0] * len(generation.prompt_ids) + response_mask), values, shared_prefix=len(generation.prompt_ids)))
    return samples


def rollout_agreement(samples: Sequence[Sample], generations: Sequence[Generation], config: GRPOConfig, parallel: Parallel) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's old policy on the sampled tokens, and with
    algorithm.rollout_correction their truncated importance weights exp(old - rollout), put on each sample."""
    correction = config.algorithm.rollout_correction
    diff_sum = diff_max = kl_sum = tokens = 0.0
    weights, capped = [], 0.0
    for sample, generation in zip(samples, generations):
        start = len(generation.prompt_ids)
        mask = generation.mask
        old, rollout = sample.token_values["old_log_prob"][start:], sample.token_values["rollout_log_prob"][start:]
        difference = (old.exp() - rollout.exp()).abs() * mask
        diff_sum, diff_max = diff_sum + float(difference.sum()), max(diff_max, float(difference.max()))
        kl_sum, tokens = kl_sum + float(((rollout - old) * mask).sum()), tokens + float(mask.sum())
        if correction.rollout_is is not None:
            weight, raw = core_algos.rollout_is_weights(old, rollout, mask, correction.rollout_is, correction.rollout_is_threshold)
            sample.token_values["rollout_is_weight"] = aligned(weight, start)
            kept = raw[mask > 0] if correction.rollout_is == "token" else raw[:1]
            weights += kept.tolist()
            capped += float((kept > correction.rollout_is_threshold).sum())
    diff_sum, kl_sum, tokens = all_reduce_sum([diff_sum, kl_sum, tokens], parallel.device, parallel.dp_group)
    metrics = {"training/rollout_probs_diff_mean": diff_sum / max(tokens, 1.0),
               "training/rollout_probs_diff_max": max_over_ranks(diff_max, parallel.device)}
    if correction.rollout_is is not None:
        metrics.update({f"rollout_corr/rollout_is_{k.rsplit('/', 1)[1]}": v for k, v in global_stats("weights", weights, parallel).items()})
        capped, count = all_reduce_sum([capped, len(weights)], parallel.device, parallel.dp_group)
        metrics["rollout_corr/rollout_is_capped_fraction"] = capped / count
        metrics["rollout_corr/kl"] = kl_sum / max(tokens, 1.0)
    return metrics


def outcome_rewards(scores: torch.Tensor, generations: Sequence[Generation]) -> list[torch.Tensor]:
    """Per-response-token rewards: each response's score on its last produced token."""
    rewards = []
    for value, generation in zip(scores, generations):
        mask = generation.mask
        reward = torch.zeros_like(mask)
        reward[int(mask.nonzero().max())] = value
        rewards.append(reward)
    return rewards


def penalize_kl(token_rewards: list[torch.Tensor], samples: Sequence[Sample], generations: Sequence[Generation],
                kl_ctrl: core_algos.KLController, config: GRPOConfig, parallel: Parallel) -> dict[str, float]:
    """verl's KL in the reward: subtract the controller's coefficient times the per-token KL of the old policy to the
    reference, then move the coefficient by the batch's mean KL (each sequence's token mean, over every rank)."""
    beta, sequence_means = kl_ctrl.value, []
    for reward, sample, generation in zip(token_rewards, samples, generations):
        start = len(generation.prompt_ids)
        kl = core_algos.kl_penalty(sample.token_values["old_log_prob"][start:], sample.token_values["ref_log_prob"][start:],
                                   config.algorithm.kl_penalty)
        mask = generation.mask
        reward -= beta * kl * mask
        sequence_means.append(float((kl * mask).sum() / mask.sum().clamp(min=1)))
    total, count = all_reduce_sum([sum(sequence_means), float(len(sequence_means))], parallel.device, parallel.dp_group)
    kl_ctrl.update(total / count, n_steps=int(count))
    return {"actor/reward_kl_penalty": total / count, "actor/reward_kl_penalty_coeff": beta}


def token_advantages(token_rewards: list[torch.Tensor], generations: Sequence[Generation], n: int, config: GRPOConfig,
                     parallel: Parallel) -> list[torch.Tensor]:
    """Each response's per-token advantages: a group estimator's value (from the summed rewards) on every token, or
    REINFORCE++'s discounted returns; the REINFORCE++ variants are whitened over every rank's response tokens."""
    algorithm = config.algorithm
    masks = [g.mask for g in generations]
    if algorithm.adv_estimator == "reinforce_plus_plus":
        advantages = [core_algos.discounted_returns(reward, mask, algorithm.gamma) for reward, mask in zip(token_rewards, masks)]
    else:
        scores = torch.stack([reward.sum() for reward in token_rewards])
        groups = torch.arange(len(scores)) // n
        per_sequence = core_algos.group_advantages(scores, groups, algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo)
        advantages = [value * mask for value, mask in zip(per_sequence, masks)]
    if algorithm.adv_estimator.startswith("reinforce_plus_plus"):
        flat, mask = torch.cat(advantages), torch.cat(masks)
        total, squares, count = all_reduce_sum([float((flat * mask).sum()), float((flat.square() * mask).sum()), float(mask.sum())],
                                               parallel.device, parallel.dp_group)
        advantages = [core_algos.masked_whiten(a, m, total, squares, count) for a, m in zip(advantages, masks)]
    return advantages


def aligned(values: list[float] | torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Per-response-token values placed at their tokens' positions in prompt + response."""
    values = torch.as_tensor(values, dtype=torch.float32)
    return torch.cat([torch.zeros(prompt_length), values])


@torch.no_grad()
def compute_log_probs(model: nn.Module, samples: Sequence[Sample], batching: MicroBatching, config: GRPOConfig, parallel: Parallel,
                      pad_id: int, key: str) -> None:
    """Each sample's log-probs of its own tokens, at the rollout temperature, through the engine's chunked path,
    stored as its token values `key` (aligned with input_ids; 0 where not trained); under Ulysses the slices are
    joined into whole rows."""
    model_config, packed = config.actor_rollout_ref.model, config.actor_rollout_ref.model.use_remove_padding
    for micro_batch in plan_micro_batches(list(samples), batching, parallel):
        batch = collate(micro_batch or samples[:1], packed, pad_id, parallel, model_config.share_prompts)
        log_probs, _ = token_log_probs(model, batch.inputs, batch.targets["labels"], config.actor_rollout_ref.rollout.temperature,
                                       model_config.chunked_loss_tokens, sp_group=parallel.ulysses_group, token_rows=batch.token_rows)
        store_token_log_probs(log_probs, micro_batch, batch, packed, parallel, key)


def store_token_log_probs(log_probs: torch.Tensor, micro_batch: list[Sample] | None, batch: MicroBatch, packed: bool, parallel: Parallel,
                          key: str) -> None:
    """A micro-batch's log-probs (a slice of every row under Ulysses: joined here, so every rank of the group
    calls it) stored on each of its samples as token values `key`, aligned with input_ids."""
    if parallel.sp_size > 1:
        log_probs = gather_sequence(log_probs[None], parallel.ulysses_group)[0]
    if micro_batch is None:
        return
    width = batch.inputs["input_ids"].shape[1]
    start = 0
    for row, sample in enumerate(micro_batch):
        offset = start if packed else row * width
        values = log_probs[offset : offset + len(sample)].detach().cpu()
        sample.token_values[key] = torch.cat([torch.zeros(1), values[:-1]])  # position t predicts token t + 1
        start += len(sample)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, targets: dict[str, torch.Tensor], num_sequences: int,
                  parallel: Parallel) -> torch.Tensor:
    """On each token, the mean of `values` over its sequence's response tokens, summed over the Ulysses slices
    that hold parts of the sequence."""
    sequences = targets["sequence"].long()
    sums = core_algos.sequence_sums(values * mask, sequences, num_sequences)
    if parallel.sp_size > 1:
        dist.all_reduce(sums, group=parallel.ulysses_group)
    return sums[sequences] / targets["sequence_tokens"].clamp(min=1)


def mini_batch_backward(model: nn.Module, mini: list[Sample], config: GRPOConfig, parallel: Parallel, pad_id: int,
                        first_pass_is_old: bool) -> dict[str, float]:
    """Gradients of one mini-batch's loss (this rank's samples of it), accumulated into the parameters. Every loss
    term of a micro-batch is this rank's share of the mini-batch's loss over its global token and sequence
    counts, so the gradient does not depend on the micro-batch size, the packing or the number of ranks.
    Returns this rank's sums of the per-token metrics and its token count."""
    actor, rollout, model_config = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    packed = model_config.use_remove_padding
    batching = config.micro_batching(actor.ppo_micro_batch_size_per_gpu, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    local = [sum(float(s.loss_mask[1:].sum()) for s in mini), sum(float(s.loss_mask[1:].any()) for s in mini)]
    global_tokens, global_sequences = all_reduce_sum(local, parallel.device, parallel.dp_group)
    num_sequences = int(max(s.token_values["sequence"][0] for s in mini)) + 1
    sums = {key: 0.0 for key in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss", "tokens")}
    for micro_batch in plan_micro_batches(mini, batching, parallel):
        # A rank with fewer micro-batches runs a forward that counts for nothing (FSDP needs every rank).
        batch = collate(micro_batch or mini[:1], packed, pad_id, parallel, model_config.share_prompts)
        targets = {k: v.flatten() for k, v in batch.targets.items()}
        mask = (targets["labels"] != IGNORE_INDEX).float() * (0.0 if micro_batch is None else 1.0)
        log_probs, entropy = token_log_probs(model, batch.inputs, targets["labels"], rollout.temperature, model_config.chunked_loss_tokens,
                                             with_entropy=True, sp_group=parallel.ulysses_group, token_rows=batch.token_rows)
        old = log_probs.detach() if first_pass_is_old else targets["old_log_prob"]
        if first_pass_is_old and "rollout_log_prob" in targets:  # kept for the engine's agreement metrics
            store_token_log_probs(old, micro_batch, batch, packed, parallel, "old_log_prob")
        sequence_log_ratio = None
        if actor.policy_loss.loss_mode == "gspo":
            sequence_log_ratio = sequence_mean(log_probs.detach() - old, mask, targets, num_sequences, parallel)
        pg, clipped, lower = core_algos.POLICY_LOSS[actor.policy_loss.loss_mode](
            log_probs, old, targets["advantage"], mask, sequence_log_ratio, low, high, actor.clip_ratio_c)
        if "rollout_is_weight" in targets:
            pg = pg * targets["rollout_is_weight"]
        aggregate = partial(core_algos.agg_loss, mask=mask, sequence_tokens=targets["sequence_tokens"], mode=actor.loss_agg_mode,
                            global_tokens=global_tokens, global_sequences=global_sequences,
                            max_response_length=config.data.max_response_length, loss_scale_factor=actor.loss_scale_factor)
        loss = aggregate(pg) - actor.entropy_coeff * aggregate(entropy)
        if actor.use_kl_loss:
            kl = core_algos.kl_penalty(log_probs, targets["ref_log_prob"], actor.kl_loss_type)
            loss = loss + actor.kl_loss_coef * aggregate(kl)
            sums["kl_loss"] += float((kl.detach() * mask).sum())
        (loss * parallel.world_size).backward()  # FSDP averages gradients over ranks
        sums["pg_loss"] += float((pg.detach() * mask).sum())
        sums["pg_clipfrac"] += float(clipped.sum())
        sums["pg_clipfrac_lower"] += float(lower.sum())
        sums["ppo_kl"] += float(((old - log_probs.detach()) * mask).sum())
        sums["entropy"] += float((entropy.detach() * mask).sum())
        sums["tokens"] += float(mask.sum())
    return sums


def update(model: nn.Module, optimizer, samples: list[Sample], config: GRPOConfig, parallel: Parallel, pad_id: int,
           first_pass_is_old: bool) -> dict[str, float]:
    """ppo_epochs passes over the mini-batches, each one clipped optimizer step; the metrics are token means."""
    actor = config.actor_rollout_ref.actor
    per_mini = actor.ppo_mini_batch_size // parallel.dp_size * config.actor_rollout_ref.rollout.n
    totals, norms, applied_all = {}, [], True
    order = list(range(len(samples)))
    for epoch in range(actor.ppo_epochs):
        if actor.shuffle:
            order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(config.trainer.seed + epoch)).tolist()
        for first in range(0, len(samples), per_mini):
            mini = [samples[i] for i in sorted(order[first : first + per_mini])]  # a group's responses side by side, to share their prompt
            for key, value in mini_batch_backward(model, mini, config, parallel, pad_id, first_pass_is_old).items():
                totals[key] = totals.get(key, 0.0) + value
            norm, applied = clipped_step(model, optimizer, actor.grad_clip)
            norms.append(norm)
            applied_all &= applied
    totals = dict(zip(totals, all_reduce_sum(list(totals.values()), parallel.device)))  # per-token sums over sequence slices
    tokens = max(totals.pop("tokens"), 1.0)
    metrics = {f"actor/{key}": value / tokens for key, value in totals.items()}
    metrics["actor/grad_norm"] = sum(norms) / len(norms)
    metrics["actor/update_skipped"] = float(not applied_all)
    return metrics


def validate(rollout: RolloutEngine, prompts: Sequence[Prompt], reward_fn: RewardFn, tokenizer, config: GRPOConfig, parallel: Parallel) -> dict:
    """Greedy (val_kwargs) accuracy and mean reward per data_source, each rank answering a share of the prompts."""
    val = config.actor_rollout_ref.rollout.val_kwargs
    mine = list(prompts[parallel.rank :: parallel.world_size])
    # Every rank calls the engine, with or without prompts: a tensor-parallel engine needs all of its ranks.
    records = evaluate(rollout, tokenizer, mine, reward_fn, val.n, val.temperature if val.do_sample else 0.0,
                       config.data.max_response_length, config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu)
    metrics = {}
    for source, figures in summarize(gather_lists(records)).items():
        metrics[f"val-core/{source}/acc/mean@{val.n}"] = figures["acc"]
        metrics[f"val-core/{source}/reward/mean@{val.n}"] = figures["score"]
    return metrics


def sync_weights(model: nn.Module, rollout: RolloutEngine, config: GRPOConfig) -> None:
    bucket_megabytes = config.actor_rollout_ref.rollout.update_weights_bucket_megabytes
    rollout.update_weights(full_parameters(model, rollout.dtype, bucket_bytes=bucket_megabytes * 2**20))


def build_rollout(config: GRPOConfig, parallel: Parallel, pad_id: int) -> RolloutEngine:
    """The rollout engine that `rollout.name` names, in the actor's compute dtype; its weights come from the
    trainer's first sync."""
    model, rollout, actor = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor
    dtype = DTYPES[actor.fsdp_config.mixed_precision.param_dtype or ("bf16" if parallel.device.type == "cuda" else "fp32")]
    if rollout.name == "hf":
        return HFRollout(model.path, parallel.device, dtype, pad_id, model.trust_remote_code)
    from fsdptrain.rl.rollout.vllm import EngineSettings, VLLMRollout

    settings = EngineSettings(rollout.gpu_memory_utilization, rollout.max_num_seqs, rollout.max_num_batched_tokens, rollout.enable_chunked_prefill,
                              rollout.enforce_eager, rollout.free_cache_engine, rollout.load_format)
    return VLLMRollout(model.path, dtype, config.sequence_length, config.trainer.seed + rollout_engine_index(config, parallel), settings,
                       distributed=True, trust_remote_code=model.trust_remote_code, tensor_parallel_size=rollout.tensor_model_parallel_size)


def rollout_engine_index(config: GRPOConfig, parallel: Parallel) -> int:
    """Which rollout engine this rank belongs to: each group of `tensor_model_parallel_size` consecutive ranks
    shares one, so they must sample from one seed."""
    return parallel.rank // config.actor_rollout_ref.rollout.tensor_model_parallel_size


def global_stats(name: str, values: Sequence[float], parallel: Parallel) -> dict[str, float]:
    """Mean, max and min of per-sample values over the step (each sample once: the data-parallel group)."""
    total, count = all_reduce_sum([float(sum(values)), float(len(values))], parallel.device, parallel.dp_group)
    return {f"{name}/mean": total / max(count, 1.0), f"{name}/max": max_over_ranks(max(values, default=-math.inf), parallel.device),
            f"{name}/min": -max_over_ranks(-min(values, default=math.inf), parallel.device)}


def run_grpo(config: GRPOConfig) -> None:
    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    parallel = start_run(config.trainer, sp_size=actor.ulysses_sequence_parallel_size)
    check_rl_layout(config, parallel.dp_size, parallel.world_size)
    model_config, rollout_config = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout
    path, path_key = model_config.path, "actor_rollout_ref.model.path"
    hf_config = load_model_config(path, path_key, model_config, parallel.sp_size)
    tokenizer = load_tokenizer(path, path_key, model_config)
    if config.sequence_length > getattr(hf_config, "max_position_embeddings", config.sequence_length):
        raise ConfigError(f"data.max_prompt_length + data.max_response_length = {config.sequence_length} exceeds the model's "
                          f"max_position_embeddings ({hf_config.max_position_embeddings})")
    reward_fn = load_reward_function(config.custom_reward_function.path, config.custom_reward_function.name)
    kwargs = config.data.apply_chat_template_kwargs
    train = fit_prompts(load_prompts(config.data.train_files, tokenizer, kwargs), config, "data.train_files")
    val = fit_prompts(load_prompts(config.data.val_files, tokenizer, kwargs), config, "data.val_files") if config.data.val_files else []
    steps_per_epoch = len(train) // config.data.train_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"data.train_batch_size ({config.data.train_batch_size}) exceeds the {len(train)} training prompts")
    total_steps = config.trainer.total_training_steps or config.trainer.total_epochs * steps_per_epoch

    kl_ctrl = None
    if algorithm.use_kl_in_reward:
        kl_ctrl = core_algos.KLController(algorithm.kl_ctrl.type, algorithm.kl_ctrl.kl_coef, algorithm.kl_ctrl.target_kl, algorithm.kl_ctrl.horizon)
    cursor = PromptCursor()
    run = open_run(parallel, config.trainer, path, model_config, actor.fsdp_config, actor.optim, hf_config, tokenizer,
                   packed=model_config.use_remove_padding, total_steps=total_steps, run_config=asdict(config),
                   states={"prompts": cursor, **({"kl_ctrl": kl_ctrl} if kl_ctrl is not None else {})})
    model, step, pad_id = run.model, run.step, tokenizer.pad_token_id
    reference = None
    if actor.use_kl_loss or algorithm.use_kl_in_reward:
        ref_fsdp = type(actor.fsdp_config)(**{**vars(actor.fsdp_config), "cpu_offload": config.actor_rollout_ref.ref.fsdp_config.param_offload})
        reference = build_sharded_model(path, model_config, ref_fsdp, hf_config, config.trainer, parallel, model_config.use_remove_padding,
                                        trainable=False)
    rollout = build_rollout(config, parallel, pad_id)
    sync_weights(model, rollout, config)  # the resumed weights, before the first rollout
    if val and config.trainer.val_before_train and step == 0:
        run.logger.log(validate(rollout, val, reward_fn, tokenizer, config, parallel), 0)
    log_prob_batching = config.micro_batching(rollout_config.log_prob_micro_batch_size_per_gpu,
                                              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")
    ref_batching = config.micro_batching(config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
                                         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")
    # One mini-batch, one epoch: the old policy is the current one (ratio exactly 1), unless the reward's KL or the
    # rollout correction needs its log-probs before the loss. The engine's agreement metrics can wait for the update's
    # forward, which computes the same log-probs.
    one_pass = (actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == config.data.train_batch_size and kl_ctrl is None
                and algorithm.rollout_correction.rollout_is is None)
    draw = partial(draw_groups, train, cursor, rollout, reward_fn, tokenizer, config, parallel)
    history = []  # this process's steps, for the plots
    while step < total_steps:
        timing, metrics, start = {}, {}, time.perf_counter()
        with profile_step(step + 1 == config.trainer.profile_step, step + 1, config.trainer.default_local_dir, parallel.rank):
            tick = time.perf_counter()
            if algorithm.filter_groups.enable:
                groups, rounds = varied_groups(draw, config, parallel)
                metrics["train/num_gen_batches"] = rounds
            else:
                groups = draw()
            prompts = [g.prompt for g in groups]
            generations = [generation for g in groups for generation in g.generations]
            scored = [s for g in groups for s in g.scored]
            timing["gen"] = time.perf_counter() - tick

            samples = make_samples(generations, actor.mask_truncated_completions)
            if not one_pass:
                tick = time.perf_counter()
                compute_log_probs(model, samples, log_prob_batching, config, parallel, pad_id, "old_log_prob")
                timing["old_log_prob"] = time.perf_counter() - tick
            if rollout_log_probs_needed(config) and not one_pass:
                metrics.update(rollout_agreement(samples, generations, config, parallel))
            if reference is not None:
                tick = time.perf_counter()
                compute_log_probs(reference, samples, ref_batching, config, parallel, pad_id, "ref_log_prob")
                timing["ref"] = time.perf_counter() - tick

            tick = time.perf_counter()
            scores = torch.tensor([s["seq_reward"] for s in scored])
            token_rewards = outcome_rewards(scores, generations)
            if kl_ctrl is not None:
                metrics.update(penalize_kl(token_rewards, samples, generations, kl_ctrl, config, parallel))
            timing["reward"] = time.perf_counter() - tick
            tick = time.perf_counter()
            advantages = token_advantages(token_rewards, generations, rollout_config.n, config, parallel)
            for sample, generation, advantage in zip(samples, generations, advantages):
                sample.token_values["advantage"] = aligned(advantage, len(generation.prompt_ids))
            timing["adv"] = time.perf_counter() - tick

            tick = time.perf_counter()
            lr = run.scheduler.get_last_lr()[0]
            metrics.update(update(model, run.optimizer, samples, config, parallel, pad_id, first_pass_is_old=one_pass))
            run.scheduler.step()
            timing["update_actor"] = time.perf_counter() - tick
            if rollout_log_probs_needed(config) and one_pass:  # the old log-probs came from the update's forward
                metrics.update(rollout_agreement(samples, generations, config, parallel))
            tick = time.perf_counter()
            sync_weights(model, rollout, config)
            timing["update_weights"] = time.perf_counter() - tick
        step += 1

        response_advantages = [float(a[g.mask > 0].mean()) for a, g in zip(advantages, generations)]
        metrics.update(step_metrics(prompts, generations, scores, token_rewards, response_advantages, config, parallel))
        metrics["actor/lr"] = lr
        if actor.use_kl_loss:
            metrics["actor/kl_coef"] = actor.kl_loss_coef
        last = step == total_steps
        if val and (last or (config.trainer.test_freq > 0 and step % config.trainer.test_freq == 0)):
            tick = time.perf_counter()
            metrics.update(validate(rollout, val, reward_fn, tokenizer, config, parallel))
            timing["testing"] = time.perf_counter() - tick
        timing["step"] = time.perf_counter() - start
        metrics.update({f"timing_s/{k}": max_over_ranks(v, parallel.device) for k, v in timing.items()})
        metrics["perf/throughput"] = metrics.pop("perf/tokens") / parallel.world_size / timing["step"]
        metrics["perf/max_memory_gb"] = max_over_ranks(peak_memory_gb(parallel.device), parallel.device)
        if config.trainer.rollout_data_dir:
            dump_rollouts(config.trainer.rollout_data_dir, step, prompts, scored, response_advantages, rollout_config.n, parallel)
        run.logger.log(metrics, step)
        history.append({"step": step, **metrics})
        if last or (config.trainer.plot_freq > 0 and step % config.trainer.plot_freq == 0):
            plot(history, [len(g.response_ids) for g in generations], config, run, parallel, step)
        run.bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}", length=f"{metrics['response_length/mean']:.0f}")
        run.bar.update(1)
        if last or (config.trainer.save_freq > 0 and step % config.trainer.save_freq == 0):
            run.checkpoints.save(step)
    run.finish(shutdown=rollout.shutdown)


def step_metrics(prompts: Sequence[Prompt], generations: Sequence[Generation], scores: torch.Tensor, token_rewards: list[torch.Tensor],
                 response_advantages: list[float], config: GRPOConfig, parallel: Parallel) -> dict[str, float]:
    """verl's per-step data metrics over every sample of the step, and its token count for the throughput."""
    n = config.actor_rollout_ref.rollout.n
    lengths = [len(g.response_ids) for g in generations]
    metrics = {**global_stats("critic/score", scores.tolist(), parallel),
               "critic/rewards/mean": global_stats("critic/rewards", [float(r.sum()) for r in token_rewards], parallel)["critic/rewards/mean"],
               **global_stats("critic/advantages", response_advantages, parallel), **global_stats("response_length", lengths, parallel)}
    prompt_stats = global_stats("prompt_length", [len(p.ids) for p in prompts], parallel)
    metrics.update({k: v for k, v in prompt_stats.items() if not k.endswith("/min")})
    group_spread = scores.view(-1, n).std(dim=1) if n > 1 else torch.zeros(len(prompts))
    tokens, truncated, responses, zero_std, groups = all_reduce_sum(
        [float(sum(lengths) + sum(len(g.prompt_ids) for g in generations)), float(sum(g.truncated for g in generations)),
         float(len(lengths)), float((group_spread == 0).sum()), float(len(group_spread))], parallel.device, parallel.dp_group)
    metrics["response_length/clip_ratio"] = truncated / max(responses, 1.0)
    metrics["frac_reward_zero_std"] = zero_std / max(groups, 1.0)
    metrics["perf/tokens"] = tokens
    return metrics


def plot(history: list[dict], lengths: list[int], config: GRPOConfig, run: Run, parallel: Parallel, step: int) -> None:
    """The plots of the steps so far (rank 0 draws them from every sample's response length)."""
    every_length = gather_lists(lengths, parallel.dp_group)
    if parallel.is_main:
        paths = write_plots(history, every_length, os.path.join(config.trainer.default_local_dir, "plots"))
        run.logger.log_images(paths, step)


def dump_rollouts(directory: str, step: int, prompts: Sequence[Prompt], scored: list[dict], advantages: list[float], n: int,
                  parallel: Parallel) -> None:
    """`{directory}/{step}.jsonl`: each response with its prompt, ground truth, scores and advantage (rank 0 writes)."""
    rows = [{"prompt": prompts[i // n].messages, "ground_truth": prompts[i // n].ground_truth, "data_source": prompts[i // n].data_source,
             **s, "advantage": a} for i, (s, a) in enumerate(zip(scored, advantages))]
    every_row = gather_lists(rows, parallel.dp_group)
    if parallel.is_main:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{step}.jsonl"), "w") as f:
            for row in every_row:
                f.write(json.dumps(row, default=str) + "\n")
