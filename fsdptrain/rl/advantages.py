"""From scores to per-token advantages: each response's score on its last token, verl's KL penalty in the reward,
then an estimator of core_algos (a group estimator's value on every token, REINFORCE++'s returns, or GAE from a
critic's values, with the returns the critic learns), whitened over every rank where the estimator is."""

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
    """Per-response-token rewards: each response's score on its last produced token."""
    rewards = []
    for value, generation in zip(scores, generations):
        mask = generation.mask
        reward = torch.zeros_like(mask)
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


def token_advantages(token_rewards: list[torch.Tensor], generations: Sequence[Generation], group_ids: torch.Tensor,
                     settings: AdvantageSettings, parallel: Parallel, source_scores: torch.Tensor | None = None,
                     baselines: torch.Tensor | None = None, samples: Sequence[Sample] = ()) -> list[torch.Tensor]:
    """Each response's per-token advantages (`group_ids`: each response's group) by the estimator of `settings`: a
    group estimator's value (from the summed rewards) on every token; a sources estimator's, from `source_scores`
    (responses, sources; None without sources: the summed rewards alone) and the sources' weights; a token
    estimator's; a baseline estimator's, from `baselines` (each response's prompt's greedy score); an optimal-token
    estimator's, from the `samples`' old log-probs, sums of squared probabilities and rollout importance weights.
    Those registered `whitened` (or all, or none, by whiten_advantages) are whitened over every rank's response
    tokens."""
    masks, registry, estimator = [g.mask for g in generations], core_algos.ADVANTAGE_ESTIMATORS, settings.estimator
    declared = registry.info[estimator]
    kind = declared.kind
    if kind == "token":
        advantages = [registry[estimator](reward, mask, settings.gamma) for reward, mask in zip(token_rewards, masks)]
    elif kind == "optimal_token":
        advantages = optimal_token_advantages(token_rewards, masks, group_ids, samples, generations, estimator)
    elif kind == "baseline":
        advantages = [registry[estimator](reward, mask, baseline)[0] for reward, mask, baseline in zip(token_rewards, masks, baselines)]
    else:
        scores = torch.stack([reward.sum() for reward in token_rewards])
        batch_scale = nonzero_scale(scores, parallel) if declared.batch_scaled else 1.0
        group = core_algos.GroupSettings(settings.norm_by_std, batch_scale=batch_scale)
        if kind == "sources":
            weights = torch.tensor([weight for _, weight in settings.sources] or [1.0], dtype=scores.dtype)
            per_sequence = registry[estimator](scores[:, None] if source_scores is None else source_scores, weights, group_ids, group)
        else:
            lengths = torch.stack([mask.sum() for mask in masks])
            per_sequence = core_algos.group_advantages(scores, group_ids, estimator, group, lengths)
        advantages = [value * mask for value, mask in zip(per_sequence, masks)]
    if settings.whiten if settings.whiten is not None else declared.whitened:
        advantages = whitened(advantages, masks, parallel)
    return advantages


def optimal_token_advantages(token_rewards: list[torch.Tensor], masks: list[torch.Tensor], group_ids: torch.Tensor, samples: Sequence[Sample],
                             generations: Sequence[Generation], estimator: str) -> list[torch.Tensor]:
    """An optimal-token estimator over each group's responses, right-padded to the group's longest."""
    registry = core_algos.ADVANTAGE_ESTIMATORS
    advantages = [None] * len(masks)
    weighted = "rollout_is_weight" in samples[0].token_values
    for group in group_ids.unique():
        members = (group_ids == group).nonzero().flatten().tolist()
        group_advantages, _ = registry[estimator](
            pad_sequence([token_rewards[i] for i in members], batch_first=True), pad_sequence([masks[i] for i in members], batch_first=True),
            response_values(samples, generations, members, "old_log_prob"), response_values(samples, generations, members, "sum_pi_squared"),
            response_values(samples, generations, members, "rollout_is_weight") if weighted else None, registry.info[estimator].compact)
        for row, i in enumerate(members):
            advantages[i] = group_advantages[row, : len(masks[i])]
    return advantages


def response_values(samples: Sequence[Sample], generations: Sequence[Generation], members: list[int], key: str) -> torch.Tensor:
    """The token values `key` of the responses `members`, right-padded (members, longest response)."""
    return pad_sequence([samples[i].token_values[key][len(generations[i].prompt_ids):] for i in members], batch_first=True)


def nonzero_scale(scores: torch.Tensor, parallel: Parallel) -> float:
    """The batch's responses over those scored nonzero, over every rank (GPG's alpha)."""
    count, nonzero = all_reduce_sum([float(len(scores)), float((scores != 0).sum())], parallel.device, parallel.dp_group)
    return count / max(nonzero, 1.0)


def critic_advantages(token_rewards: list[torch.Tensor], samples: Sequence[Sample], generations: Sequence[Generation],
                      settings: AdvantageSettings, parallel: Parallel) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each response's per-token (advantages, returns) by a critic estimator of core_algos from the critic's values
    (the samples' token values `values`); the advantages whitened over every rank's response tokens, as verl's,
    unless whiten_advantages says not."""
    advantages, returns = [], []
    for reward, sample, generation in zip(token_rewards, samples, generations):
        values = sample.token_values["values"][len(generation.prompt_ids):]
        advantage, sample_returns = core_algos.ADVANTAGE_ESTIMATORS[settings.estimator](reward, values, generation.mask, settings.gamma,
                                                                                         settings.lam)
        advantages.append(advantage)
        returns.append(sample_returns * generation.mask)
    if settings.whiten is False:
        return advantages, returns
    return whitened(advantages, [g.mask for g in generations], parallel), returns


def whitened(advantages: list[torch.Tensor], masks: list[torch.Tensor], parallel: Parallel) -> list[torch.Tensor]:
    """Advantages whitened with the mean and variance of every rank's response tokens."""
    mean, variance = core_algos.batch_moments(torch.cat(advantages), torch.cat(masks),
                                              lambda sums: all_reduce_sum(sums, parallel.device, parallel.dp_group))
    return [core_algos.masked_whiten(a, m, mean, variance) for a, m in zip(advantages, masks)]


def put_token_values(samples: Sequence[Sample], generations: Sequence[Generation], values: Sequence[torch.Tensor], key: str) -> None:
    """Each response's per-token values on its sample as its token values `key` (the policy loss reads
    `advantage`, the value loss `returns`)."""
    for sample, generation, value in zip(samples, generations, values):
        sample.token_values[key] = aligned(value, len(generation.prompt_ids))
