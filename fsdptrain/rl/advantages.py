"""From scores to per-token advantages: each response's score on its last token, verl's KL penalty in the reward,
then the estimator of core_algos, one call on the batch padded (a group estimator's value on every token,
REINFORCE++'s returns, or GAE from a critic's values, with the returns the critic learns), whitened over every rank
where the estimator is."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from fsdptrain.data.dataset import Sample
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum
from fsdptrain.rl import core_algos
from fsdptrain.rl.rollout.base import Generation
from fsdptrain.rl.samples import aligned


@dataclass(frozen=True)
class AdvantageSettings:
    """How rewards become advantages (algorithm.*, verl's names)."""

    estimator: str  # a name in core_algos.ADVANTAGE_ESTIMATORS
    norm_by_std: bool  # norm_adv_by_std_in_grpo
    gamma: float
    lam: float
    kl_penalty: str  # the KL estimator of the KL in the reward (algorithm.use_kl_in_reward)
    clip: float | None  # algorithm.advantage_clip
    sources: tuple[tuple[str, float], ...]  # each reward source's name and weight (reward.sources, then the batch sources)
    whiten: bool | None  # whiten_advantages: over the batch's tokens, or not; None: as the estimator is registered


def outcome_rewards(scores: torch.Tensor, generations: Sequence[Generation]) -> list[torch.Tensor]:
    """Per-response-token rewards: each response's score on its last produced token (none where the policy produced
    none: a vision-language model's response that began with an image token, which the rollout leaves out)."""
    rewards = []
    for value, generation in zip(scores, generations):
        mask = generation.mask
        reward = torch.zeros_like(mask)
        if mask.any():
            reward[int(mask.nonzero().max())] = value
        rewards.append(reward)
    return rewards


def penalize_kl(token_rewards: list[torch.Tensor], samples: Sequence[Sample], generations: Sequence[Generation],
                kl_ctrl: core_algos.KLController, estimator: str, parallel: Parallel) -> dict[str, float]:
    """verl's KL in the reward: subtract the controller's coefficient times the per-token KL (`estimator`) of the old
    policy to the reference, then move the coefficient by the batch's mean KL (each sequence's token mean, over
    every rank)."""
    beta, sequence_means = kl_ctrl.value, []
    for reward, sample, generation in zip(token_rewards, samples, generations):
        start = len(generation.prompt_ids)
        kl = core_algos.kl_penalty(sample.token_values["old_log_prob"][start:], sample.token_values["ref_log_prob"][start:], estimator)
        mask = generation.mask
        reward -= beta * kl * mask
        sequence_means.append(float((kl * mask).sum() / mask.sum().clamp(min=1)))
    total, count = all_reduce_sum([sum(sequence_means), float(len(sequence_means))], parallel.device, parallel.dp_group)
    kl_ctrl.update(total / count, n_steps=int(count))
    return {"actor/reward_kl_penalty": total / count, "actor/reward_kl_penalty_coeff": beta}


def advantages_and_returns(token_rewards: list[torch.Tensor], samples: Sequence[Sample], generations: Sequence[Generation],
                           group_ids: torch.Tensor, settings: AdvantageSettings, parallel: Parallel, source_scores: torch.Tensor | None = None,
                           greedy_scores: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each response's per-token (advantages, returns) by the estimator of `settings`, called as every estimator is,
    on the batch padded (core_algos.EstimatorBatch): the samples' token values that an estimator may read (the
    critic's values, the old log-probs, sums of squared probabilities and rollout importance weights) where the
    run made them, `source_scores` (responses, sources), `greedy_scores` (each response's prompt's greedy score).
    Those registered `whitened` (or all, or none, by whiten_advantages) are whitened over every rank's response
    tokens."""
    declared = core_algos.ADVANTAGE_ESTIMATORS.info[settings.estimator]
    rewards, mask = pad_sequence(token_rewards, batch_first=True), pad_sequence([g.mask for g in generations], batch_first=True)
    weights = torch.tensor([weight for _, weight in settings.sources] or [1.0], dtype=rewards.dtype)
    batch = core_algos.EstimatorBatch(
        rewards, mask, group_ids, settings.norm_by_std, settings.gamma, settings.lam,
        batch_scale=nonzero_scale(rewards.sum(-1), parallel) if declared.batch_scaled else 1.0,
        values=response_values(samples, generations, "values"), greedy_scores=greedy_scores,
        old_log_probs=response_values(samples, generations, "old_log_prob"), sum_pi_squared=response_values(samples, generations, "sum_pi_squared"),
        is_weights=response_values(samples, generations, "rollout_is_weight"),
        source_scores=rewards.sum(-1)[:, None] if source_scores is None else source_scores, source_weights=weights)
    advantages, returns = core_algos.ADVANTAGE_ESTIMATORS[settings.estimator](batch)
    if settings.whiten if settings.whiten is not None else declared.whitened:
        advantages = whitened(advantages, mask, parallel)
    lengths = [len(g.mask) for g in generations]
    return [a[:n] for a, n in zip(advantages, lengths)], [(r * m)[:n] for r, m, n in zip(returns, mask, lengths)]


def response_values(samples: Sequence[Sample], generations: Sequence[Generation], key: str) -> torch.Tensor | None:
    """The samples' token values `key` over their responses, right-padded (responses, longest response); None
    where the run did not make them."""
    if not samples or key not in samples[0].token_values:
        return None
    return pad_sequence([s.token_values[key][len(g.prompt_ids):] for s, g in zip(samples, generations)], batch_first=True)


def nonzero_scale(scores: torch.Tensor, parallel: Parallel) -> float:
    """The batch's responses over those scored nonzero, over every rank (GPG's alpha)."""
    count, nonzero = all_reduce_sum([float(len(scores)), float((scores != 0).sum())], parallel.device, parallel.dp_group)
    return count / max(nonzero, 1.0)


def whitened(advantages: torch.Tensor, mask: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Advantages (responses, tokens) whitened with the mean and variance of every rank's response tokens."""
    mean, variance = core_algos.batch_moments(advantages.flatten(), mask.flatten(),
                                              lambda sums: all_reduce_sum(sums, parallel.device, parallel.dp_group))
    return core_algos.masked_whiten(advantages, mask, mean, variance)


def put_token_values(samples: Sequence[Sample], generations: Sequence[Generation], values: Sequence[torch.Tensor], key: str) -> None:
    """Each response's per-token values on its sample as its token values `key` (the policy loss reads
    `advantage`, the value loss `returns`)."""
    for sample, generation, value in zip(samples, generations, values):
        sample.token_values[key] = aligned(value, len(generation.prompt_ids))
