"""How far the engine that sampled a rollout is from the trainer's old policy, and the truncated importance weights
that correct for it (algorithm.rollout_correction)."""

from collections.abc import Sequence

from fsdptrain.data.dataset import Sample
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum, max_over_ranks
from fsdptrain.rl import core_algos
from fsdptrain.rl.metrics import global_stats
from fsdptrain.rl.rollout.base import Generation
from fsdptrain.rl.samples import aligned


def rollout_agreement(samples: Sequence[Sample], generations: Sequence[Generation], rollout_is: str | None, threshold: float,
                      parallel: Parallel) -> dict[str, float]:
    """The engine's sampling log-probs against the old policy's on the sampled tokens; with `rollout_is` (token or
    sequence) their truncated importance weights exp(old - rollout), capped at `threshold`, put on each sample."""
    diff_sum = diff_max = kl_sum = tokens = 0.0
    weights, capped = [], 0.0
    for sample, generation in zip(samples, generations):
        start = len(generation.prompt_ids)
        mask = generation.mask
        old, rollout = sample.token_values["old_log_prob"][start:], sample.token_values["rollout_log_prob"][start:]
        difference = (old.exp() - rollout.exp()).abs() * mask
        diff_sum, diff_max = diff_sum + float(difference.sum()), max(diff_max, float(difference.max()))
        kl_sum, tokens = kl_sum + float(((rollout - old) * mask).sum()), tokens + float(mask.sum())
        if rollout_is is not None:
            weight, raw = core_algos.rollout_is_weights(old, rollout, mask, rollout_is, threshold)
            sample.token_values["rollout_is_weight"] = aligned(weight, start)
            kept = raw[mask > 0] if rollout_is == "token" else raw[:1]
            weights += kept.tolist()
            capped += float((kept > threshold).sum())
    diff_sum, kl_sum, tokens = all_reduce_sum([diff_sum, kl_sum, tokens], parallel.device, parallel.dp_group)
    metrics = {"training/rollout_probs_diff_mean": diff_sum / max(tokens, 1.0),
               "training/rollout_probs_diff_max": max_over_ranks(diff_max, parallel.device)}
    if rollout_is is not None:
        metrics.update({f"rollout_corr/rollout_is_{k.rsplit('/', 1)[1]}": v for k, v in global_stats("weights", weights, parallel).items()})
        capped, count = all_reduce_sum([capped, len(weights)], parallel.device, parallel.dp_group)
        metrics["rollout_corr/rollout_is_capped_fraction"] = capped / count
        metrics["rollout_corr/kl"] = kl_sum / max(tokens, 1.0)
    return metrics
