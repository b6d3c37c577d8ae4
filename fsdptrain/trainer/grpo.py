"""GRPO-family training on the shared set-up: rollout, score, advantages, old and reference log-probs, the clipped
policy update over mini-batches, and the new weights to the rollout engine.

Each data-parallel rank generates for whole prompts (train_batch_size / dp of them, `rollout.n` responses each),
so a prompt's group of responses sits on one rank; batch-wide statistics (REINFORCE++ whitening, the mini-batch's
token and sequence counts that every loss divides by) are summed over ranks.
"""

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from functools import partial

import torch
from torch import nn

from fsdptrain.config.schema import DTYPES, ConfigError, GRPOConfig, MicroBatching, check_rl_layout
from fsdptrain.data.batching import epoch_batches
from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import collate, plan_micro_batches
from fsdptrain.distributed.fsdp import full_parameters
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum, gather_lists, max_over_ranks
from fsdptrain.evaluate import evaluate, summarize
from fsdptrain.logging.plots import write_plots
from fsdptrain.models.loading import load_model_config, load_tokenizer
from fsdptrain.models.loss import IGNORE_INDEX, token_log_probs
from fsdptrain.rl import core_algos
from fsdptrain.rl.data import Prompt, load_prompts
from fsdptrain.rl.rewards import RewardFn, load_reward_function, overlong_penalty, score_sample
from fsdptrain.rl.rollout.hf import Generation, HFRollout
from fsdptrain.trainer.optim import clipped_step
from fsdptrain.trainer.runtime import log, peak_memory_gb
from fsdptrain.trainer.setup import Run, build_sharded_model, open_run, start_run


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


def score(generations: Sequence[Generation], prompts: Sequence[Prompt], reward_fn: RewardFn, tokenizer, config: GRPOConfig, step: int) -> list[dict]:
    """Each response's scores from the reward function, with DAPO's overlong penalty added to `score` where on."""
    n, overlong = config.actor_rollout_ref.rollout.n, config.reward_model.overlong_buffer
    scores = []
    for i, generation in enumerate(generations):
        prompt = prompts[i // n]
        text = tokenizer.decode(generation.response_ids, skip_special_tokens=True)
        where = f"step {step}, prompt {i // n} ({prompt.data_source}) of this rank, response {i % n}"
        scored = {**score_sample(reward_fn, prompt.data_source, text, prompt.ground_truth, prompt.extra_info, where), "response": text,
                  "response_length": len(generation.response_ids)}
        if overlong.enable:
            scored["overlong_penalty"] = overlong_penalty(len(generation.response_ids), config.data.max_response_length, overlong.len,
                                                          overlong.penalty_factor)
            scored["score"] += scored["overlong_penalty"]
        scores.append(scored)
    return scores


def outcome_rewards(scores: torch.Tensor, generations: Sequence[Generation]) -> list[torch.Tensor]:
    """Per-response-token rewards: each response's score on its last produced token."""
    rewards = []
    for value, generation in zip(scores, generations):
        mask = torch.tensor(generation.response_mask, dtype=torch.float32)
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
        mask = torch.tensor(generation.response_mask, dtype=torch.float32)
        reward -= beta * kl * mask
        sequence_means.append(float((kl * mask).sum() / mask.sum().clamp(min=1)))
    total, count = all_reduce_sum([sum(sequence_means), float(len(sequence_means))], parallel.device)
    kl_ctrl.update(total / count, n_steps=int(count))
    return {"actor/reward_kl_penalty": total / count, "actor/reward_kl_penalty_coeff": beta}


def token_advantages(token_rewards: list[torch.Tensor], generations: Sequence[Generation], n: int, config: GRPOConfig,
                     parallel: Parallel) -> list[torch.Tensor]:
    """Each response's per-token advantages: a group estimator's value (from the summed rewards) on every token, or
    REINFORCE++'s discounted returns; the REINFORCE++ variants are whitened over every rank's response tokens."""
    algorithm = config.algorithm
    masks = [torch.tensor(g.response_mask, dtype=torch.float32) for g in generations]
    if algorithm.adv_estimator == "reinforce_plus_plus":
        advantages = [core_algos.discounted_returns(reward, mask, algorithm.gamma) for reward, mask in zip(token_rewards, masks)]
    else:
        scores = torch.stack([reward.sum() for reward in token_rewards])
        groups = torch.arange(len(scores)) // n
        per_sequence = core_algos.group_advantages(scores, groups, algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo)
        advantages = [value * mask for value, mask in zip(per_sequence, masks)]
    if algorithm.adv_estimator.startswith("reinforce_plus_plus"):
        flat, mask = torch.cat(advantages), torch.cat(masks)
        total, squares, count = all_reduce_sum([float((flat * mask).sum()), float((flat.square() * mask).sum()), float(mask.sum())], parallel.device)
        advantages = [core_algos.masked_whiten(a, m, total, squares, count) for a, m in zip(advantages, masks)]
    return advantages


def aligned(values: list[float] | torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Per-response-token values placed at their tokens' positions in prompt + response."""
    values = torch.as_tensor(values, dtype=torch.float32)
    return torch.cat([torch.zeros(prompt_length), values])


@torch.no_grad()
def compute_log_probs(model: nn.Module, samples: Sequence[Sample], batching: MicroBatching, config: GRPOConfig, parallel: Parallel,
                      pad_id: int) -> list[torch.Tensor]:
    """Each sample's log-probs of its own tokens (aligned with input_ids; 0 where not trained), at the rollout
    temperature, through the engine's chunked path."""
    model_config, packed = config.actor_rollout_ref.model, config.actor_rollout_ref.model.use_remove_padding
    results = []
    for micro_batch in plan_micro_batches(list(samples), batching, parallel):
        batch = collate(micro_batch or samples[:1], packed, pad_id, parallel)
        log_probs, _ = token_log_probs(model, batch.inputs, batch.targets["labels"], config.actor_rollout_ref.rollout.temperature,
                                       model_config.chunked_loss_tokens)
        if micro_batch is None:
            continue
        width = batch.inputs["input_ids"].shape[1]
        start = 0
        for row, sample in enumerate(micro_batch):
            offset = start if packed else row * width
            values = log_probs[offset : offset + len(sample)].cpu()
            results.append(torch.cat([torch.zeros(1), values[:-1]]))  # position t predicts token t + 1
            start += len(sample)
    return results


def mini_batch_backward(model: nn.Module, mini: list[Sample], config: GRPOConfig, parallel: Parallel, pad_id: int,
                        first_pass_is_old: bool) -> dict[str, float]:
    """Gradients of one mini-batch's loss (this rank's samples of it), accumulated into the parameters. Every loss
    term of a micro-batch is this rank's share of the mini-batch's loss over its global token and sequence
    counts, so the gradient does not depend on the micro-batch size, the packing or the number of ranks.
    Returns this rank's sums of the per-token metrics and its token count."""
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    packed = config.actor_rollout_ref.model.use_remove_padding
    batching = config.micro_batching(actor.ppo_micro_batch_size_per_gpu, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    local_tokens = sum(float(s.loss_mask[1:].sum()) for s in mini)
    global_tokens, global_sequences = all_reduce_sum([local_tokens, float(len(mini))], parallel.device)
    sums = {key: 0.0 for key in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss", "tokens")}
    for micro_batch in plan_micro_batches(mini, batching, parallel):
        # A rank with fewer micro-batches runs a forward that counts for nothing (FSDP needs every rank).
        batch = collate(micro_batch or mini[:1], packed, pad_id, parallel)
        targets = {k: v.flatten() for k, v in batch.targets.items()}
        mask = (targets["labels"] != IGNORE_INDEX).float() * (0.0 if micro_batch is None else 1.0)
        log_probs, entropy = token_log_probs(model, batch.inputs, targets["labels"], rollout.temperature,
                                             config.actor_rollout_ref.model.chunked_loss_tokens, with_entropy=True)
        old = log_probs.detach() if first_pass_is_old else targets["old_log_prob"]
        sequences = targets["sequence"].long()
        pg, clipped, lower = core_algos.POLICY_LOSS[actor.policy_loss.loss_mode](
            log_probs, old, targets["advantage"], mask, sequences, low, high, actor.clip_ratio_c)
        aggregate = partial(core_algos.agg_loss, mask=mask, sequences=sequences, mode=actor.loss_agg_mode,
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
            mini = [samples[i] for i in order[first : first + per_mini]]
            for key, value in mini_batch_backward(model, mini, config, parallel, pad_id, first_pass_is_old).items():
                totals[key] = totals.get(key, 0.0) + value
            norm, applied = clipped_step(model, optimizer, actor.optim.clip_grad)
            norms.append(norm)
            applied_all &= applied
    totals = dict(zip(totals, all_reduce_sum(list(totals.values()), parallel.device)))
    tokens = max(totals.pop("tokens"), 1.0)
    metrics = {f"actor/{key}": value / tokens for key, value in totals.items()}
    metrics["actor/grad_norm"] = sum(norms) / len(norms)
    metrics["actor/update_skipped"] = float(not applied_all)
    return metrics


def validate(rollout: HFRollout, prompts: Sequence[Prompt], reward_fn: RewardFn, tokenizer, config: GRPOConfig, parallel: Parallel) -> dict:
    """Greedy (val_kwargs) accuracy and mean reward per data_source over every rank's share of the validation set."""
    val = config.actor_rollout_ref.rollout.val_kwargs
    mine = list(prompts[parallel.dp_rank :: parallel.dp_size])
    records = evaluate(rollout.model, tokenizer, mine, reward_fn, val.n, val.temperature if val.do_sample else 0.0,
                       config.data.max_response_length, config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu) if mine else []
    metrics = {}
    for source, figures in summarize(gather_lists(records, parallel)).items():
        metrics[f"val-core/{source}/acc/mean@{val.n}"] = figures["acc"]
        metrics[f"val-core/{source}/reward/mean@{val.n}"] = figures["score"]
    return metrics


def sync_weights(model: nn.Module, rollout: HFRollout) -> None:
    rollout.update_weights(full_parameters(model, rollout.model.dtype))


def global_stats(name: str, values: Sequence[float], parallel: Parallel) -> dict[str, float]:
    total, count = all_reduce_sum([float(sum(values)), float(len(values))], parallel.device)
    return {f"{name}/mean": total / max(count, 1.0), f"{name}/max": max_over_ranks(max(values), parallel.device),
            f"{name}/min": -max_over_ranks(-min(values), parallel.device)}


def run_grpo(config: GRPOConfig) -> None:
    parallel = start_run(config.trainer, sp_size=1)
    check_rl_layout(config, parallel.dp_size)
    model_config, actor = config.actor_rollout_ref.model, config.actor_rollout_ref.actor
    rollout_config, path, path_key = config.actor_rollout_ref.rollout, model_config.path, "actor_rollout_ref.model.path"
    hf_config = load_model_config(path, path_key, model_config, 1)
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

    algorithm = config.algorithm
    kl_ctrl = None
    if algorithm.use_kl_in_reward:
        kl_ctrl = core_algos.KLController(algorithm.kl_ctrl.type, algorithm.kl_ctrl.kl_coef, algorithm.kl_ctrl.target_kl, algorithm.kl_ctrl.horizon)
    run = open_run(parallel, config.trainer, path, model_config, actor.fsdp_config, actor.optim, hf_config, tokenizer,
                   packed=model_config.use_remove_padding, total_steps=total_steps, run_config=asdict(config),
                   states={"kl_ctrl": kl_ctrl} if kl_ctrl is not None else None)
    model, step = run.model, run.step
    reference = None
    if actor.use_kl_loss or algorithm.use_kl_in_reward:
        ref_fsdp = type(actor.fsdp_config)(**{**vars(actor.fsdp_config), "cpu_offload": config.actor_rollout_ref.ref.fsdp_config.param_offload})
        reference = build_sharded_model(path, model_config, ref_fsdp, hf_config, config.trainer, parallel, model_config.use_remove_padding,
                                        trainable=False)
    param_dtype = actor.fsdp_config.mixed_precision.param_dtype or ("bf16" if parallel.device.type == "cuda" else "fp32")
    rollout = HFRollout(path, parallel.device, DTYPES[param_dtype], tokenizer.pad_token_id, model_config.trust_remote_code)
    sync_weights(model, rollout)  # the resumed weights, before the first rollout
    if val and config.trainer.val_before_train and step == 0:
        run.logger.log(validate(rollout, val, reward_fn, tokenizer, config, parallel), 0)
    per_rank = config.data.train_batch_size // parallel.dp_size
    log_prob_batching = config.micro_batching(rollout_config.log_prob_micro_batch_size_per_gpu,
                                              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")
    ref_batching = config.micro_batching(config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
                                         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")
    # One mini-batch, one epoch: the old policy is the current one (ratio exactly 1), unless the reward's KL needs it first.
    one_pass = actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == config.data.train_batch_size and kl_ctrl is None
    history = []  # this process's steps, for the plots
    while step < total_steps:
        epoch, index = divmod(step, steps_per_epoch)
        batch = epoch_batches(len(train), config.data.train_batch_size, config.trainer.seed, epoch, config.data.shuffle)[index]
        prompts = [train[i] for i in batch[parallel.dp_rank * per_rank : (parallel.dp_rank + 1) * per_rank]]
        timing, start = {}, time.perf_counter()

        tick = time.perf_counter()
        torch.manual_seed(config.trainer.seed * 1_000_003 + step * parallel.world_size + parallel.rank)  # resumable sampling
        rollout.wake_up()
        generations = rollout.generate([p.ids for p in prompts], rollout_config.n, config.data.max_response_length,
                                       rollout_config.log_prob_micro_batch_size_per_gpu, temperature=rollout_config.temperature,
                                       top_p=rollout_config.top_p, top_k=rollout_config.top_k, do_sample=rollout_config.do_sample,
                                       calculate_log_probs=rollout_config.calculate_log_probs)
        rollout.sleep()
        timing["gen"] = time.perf_counter() - tick

        samples = [
            Sample(torch.tensor(g.prompt_ids + g.response_ids), torch.tensor([0] * len(g.prompt_ids) + g.response_mask),
                   {"sequence": torch.full((len(g.prompt_ids) + len(g.response_ids),), float(i))})
            for i, g in enumerate(generations)
        ]
        if not one_pass:
            tick = time.perf_counter()
            for sample, values in zip(samples, compute_log_probs(model, samples, log_prob_batching, config, parallel, tokenizer.pad_token_id)):
                sample.token_values["old_log_prob"] = values
            timing["old_log_prob"] = time.perf_counter() - tick
        if reference is not None:
            tick = time.perf_counter()
            for sample, values in zip(samples, compute_log_probs(reference, samples, ref_batching, config, parallel, tokenizer.pad_token_id)):
                sample.token_values["ref_log_prob"] = values
            timing["ref"] = time.perf_counter() - tick

        tick = time.perf_counter()
        scored = score(generations, prompts, reward_fn, tokenizer, config, step + 1)
        scores = torch.tensor([s["score"] for s in scored])
        token_rewards = outcome_rewards(scores, generations)
        if kl_ctrl is not None:
            kl_metrics = penalize_kl(token_rewards, samples, generations, kl_ctrl, config, parallel)
        timing["reward"] = time.perf_counter() - tick
        tick = time.perf_counter()
        advantages = token_advantages(token_rewards, generations, rollout_config.n, config, parallel)
        for sample, generation, advantage in zip(samples, generations, advantages):
            sample.token_values["advantage"] = aligned(advantage, len(generation.prompt_ids))
        timing["adv"] = time.perf_counter() - tick

        tick = time.perf_counter()
        lr = run.scheduler.get_last_lr()[0]
        metrics = update(model, run.optimizer, samples, config, parallel, tokenizer.pad_token_id, first_pass_is_old=one_pass)
        run.scheduler.step()
        timing["update_actor"] = time.perf_counter() - tick
        tick = time.perf_counter()
        sync_weights(model, rollout)
        timing["update_weights"] = time.perf_counter() - tick
        step += 1

        lengths = [len(g.response_ids) for g in generations]
        tokens = all_reduce_sum([float(sum(lengths) + sum(len(g.prompt_ids) for g in generations))], parallel.device)[0]
        group_spread = scores.view(-1, rollout_config.n).std(dim=1) if rollout_config.n > 1 else torch.zeros(len(prompts))
        zero_std, groups = all_reduce_sum([float((group_spread == 0).sum()), float(len(group_spread))], parallel.device)
        response_advantages = [float(a[m > 0].mean()) for a, m in ((a, torch.tensor(g.response_mask)) for a, g in zip(advantages, generations))]
        metrics.update(global_stats("critic/score", scores.tolist(), parallel))
        metrics["critic/rewards/mean"] = global_stats("critic/rewards", [float(r.sum()) for r in token_rewards], parallel)["critic/rewards/mean"]
        metrics.update(global_stats("critic/advantages", response_advantages, parallel))
        metrics.update(global_stats("response_length", lengths, parallel))
        truncated, count = all_reduce_sum([float(sum(g.truncated for g in generations)), float(len(generations))], parallel.device)
        metrics["response_length/clip_ratio"] = truncated / count
        prompt_stats = global_stats("prompt_length", [len(p.ids) for p in prompts], parallel)
        metrics.update({k: v for k, v in prompt_stats.items() if not k.endswith("/min")})
        metrics["frac_reward_zero_std"] = zero_std / max(groups, 1.0)
        metrics["actor/lr"] = lr
        if actor.use_kl_loss:
            metrics["actor/kl_coef"] = actor.kl_loss_coef
        if kl_ctrl is not None:
            metrics.update(kl_metrics)
        last = step == total_steps
        if val and (last or (config.trainer.test_freq > 0 and step % config.trainer.test_freq == 0)):
            tick = time.perf_counter()
            metrics.update(validate(rollout, val, reward_fn, tokenizer, config, parallel))
            timing["testing"] = time.perf_counter() - tick
        timing["step"] = time.perf_counter() - start
        metrics.update({f"timing_s/{k}": max_over_ranks(v, parallel.device) for k, v in timing.items()})
        metrics["perf/throughput"] = tokens / parallel.world_size / timing["step"]
        metrics["perf/max_memory_gb"] = max_over_ranks(peak_memory_gb(parallel.device), parallel.device)
        if config.trainer.rollout_data_dir:
            dump_rollouts(config.trainer.rollout_data_dir, step, prompts, scored, response_advantages, rollout_config.n, parallel)
        run.logger.log(metrics, step)
        history.append({"step": step, **metrics})
        if last or (config.trainer.plot_freq > 0 and step % config.trainer.plot_freq == 0):
            plot(history, lengths, config, run, parallel, step)
        run.bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}", length=f"{metrics['response_length/mean']:.0f}")
        run.bar.update(1)
        if last or (config.trainer.save_freq > 0 and step % config.trainer.save_freq == 0):
            run.checkpoints.save(step)
    run.finish()


def plot(history: list[dict], lengths: list[int], config: GRPOConfig, run: Run, parallel: Parallel, step: int) -> None:
    """The plots of the steps so far (rank 0 draws them from every rank's response lengths)."""
    every_length = gather_lists(lengths, parallel)
    if parallel.is_main:
        paths = write_plots(history, every_length, os.path.join(config.trainer.default_local_dir, "plots"))
        run.logger.log_images(paths, step)


def dump_rollouts(directory: str, step: int, prompts: Sequence[Prompt], scored: list[dict], advantages: list[float], n: int,
                  parallel: Parallel) -> None:
    """`{directory}/{step}.jsonl`: each response with its prompt, ground truth, scores and advantage (rank 0 writes)."""
    rows = [{"prompt": prompts[i // n].messages, "ground_truth": prompts[i // n].ground_truth, "data_source": prompts[i // n].data_source,
             **s, "advantage": a} for i, (s, a) in enumerate(zip(scored, advantages))]
    every_row = gather_lists(rows, parallel)
    if parallel.is_main:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{step}.jsonl"), "w") as f:
            for row in every_row:
                f.write(json.dumps(row, default=str) + "\n")
