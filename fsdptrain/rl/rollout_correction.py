"""How far the engine that sampled a rollout is from the trainer's old policy, and what corrects for it
(algorithm.rollout_correction, verl's decoupled mode): importance weights on the loss, and rejection of the
tokens or responses whose divergence leaves its bounds."""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdptrain.data.dataset import Sample
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum, max_over_ranks
from fsdptrain.rl import core_algos
from fsdptrain.rl.core_algos import RejectionRule
from fsdptrain.rl.metrics import global_stats
from fsdptrain.rl.rollout.base import Generation
from fsdptrain.rl.samples import aligned


@dataclass(frozen=True)
class Correction:
    level: str | None  # rollout_is: token | sequence; None: no weights
    upper: float  # the weights' cap, or with `lower` the bounds outside which they are 0 (IcePop)
    lower: float | None
    batch_normalize: bool  # weights divided by their mean over the batch (its tokens, or its sequences)
    rejection: tuple[RejectionRule, ...]  # rollout_rs


def rollout_agreement(samples: Sequence[Sample], generations: Sequence[Generation], correction: Correction,
                      parallel: Parallel) -> tuple[dict[str, float], list[Generation]]:
    """The engine's sampling log-probs against the old policy's on the sampled tokens, and `correction` applied to
    the samples: their importance weights (token values), rejected tokens out of their loss masks. Returns the
    metrics and the generations as the advantages see them (rejected tokens out of their response masks: the
    rewards stay where the engine's responses put them)."""
    diff_sum = diff_max = kl_sum = tokens = 0.0
    weights, outside, rejected_tokens, rejected_responses = [], 0.0, 0.0, 0.0
    trained, weighted = list(generations), []
    for i, (sample, generation) in enumerate(zip(samples, generations)):
        start = len(generation.prompt_ids)
        mask = generation.mask
        old, rollout = sample.token_values["old_log_prob"][start:], sample.token_values["rollout_log_prob"][start:]
        difference = (old.exp() - rollout.exp()).abs() * mask
        diff_sum, diff_max = diff_sum + float(difference.sum()), max(diff_max, float(difference.max()))
        kl_sum, tokens = kl_sum + float(((rollout - old) * mask).sum()), tokens + float(mask.sum())
        if correction.level is not None:
            weight, raw = core_algos.rollout_is_weights(old, rollout, mask, correction.level, correction.upper, correction.lower)
            weighted.append((sample, weight, mask, start))
            kept = raw[mask > 0] if correction.level == "token" else raw[:1]
            weights += kept.tolist()
            outside += float(((kept > correction.upper) | (kept < (correction.lower or 0.0))).sum())
        if correction.rejection:
            keep = core_algos.rejection_keep(old - rollout, mask, correction.rejection)
            rejected_tokens += float((mask - keep).sum())
            rejected_responses += float(bool((mask - keep).any()))
            trained[i] = dataclasses.replace(generation, response_mask=keep.long().tolist())
            sample.loss_mask[start:] *= keep.long()
            sample.token_values["sequence_tokens"].fill_(float(sample.loss_mask.sum()))
    diff_sum, kl_sum, tokens, responses = all_reduce_sum([diff_sum, kl_sum, tokens, len(samples)], parallel.device, parallel.dp_group)
    metrics = {"training/rollout_probs_diff_mean": diff_sum / max(tokens, 1.0),
               "training/rollout_probs_diff_max": max_over_ranks(diff_max, parallel.device, parallel.group)}
    if correction.level is not None:
        metrics.update({f"rollout_corr/rollout_is_{k.rsplit('/', 1)[1]}": v for k, v in global_stats("weights", weights, parallel).items()})
        outside, count = all_reduce_sum([outside, len(weights)], parallel.device, parallel.dp_group)
        metrics["rollout_corr/rollout_is_capped_fraction"] = outside / count
        metrics["rollout_corr/kl"] = kl_sum / max(tokens, 1.0)
        scale = batch_mean(weighted, correction.level, parallel) if correction.batch_normalize else 1.0
        if correction.batch_normalize:
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = scale
        for sample, weight, _, start in weighted:
            sample.token_values["rollout_is_weight"] = aligned(weight / scale, start)
    if correction.rejection:
        rejected_tokens, rejected_responses = all_reduce_sum([rejected_tokens, rejected_responses], parallel.device, parallel.dp_group)
        metrics["rollout_corr/rollout_rs_masked_fraction"] = rejected_tokens / max(tokens, 1.0)
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = rejected_responses / max(responses, 1.0)
    return metrics, trained


def batch_mean(weighted: Sequence[tuple[Sample, torch.Tensor, torch.Tensor, int]], level: str, parallel: Parallel) -> float:
    """The weights' mean over every rank's batch, as verl's rollout_is_batch_normalize: over the response tokens
    (token), or over the responses with a token, each once (sequence); 1 where it is not above 1e-8."""
    if level == "token":
        total, count = sum(float(w.sum()) for _, w, _, _ in weighted), sum(float(m.sum()) for _, _, m, _ in weighted)
    else:
        total = sum(float(w.sum() / (m.sum() + 1e-8)) for _, w, m, _ in weighted)
        count = sum(float(m.sum() > 0) for _, _, m, _ in weighted)
    total, count = all_reduce_sum([total, count], parallel.device, parallel.dp_group)
    mean = total / max(count, 1e-8)
    return mean if mean > 1e-8 else 1.0
