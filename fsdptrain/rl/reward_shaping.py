"""Reward normalization and clipping, and advantage clipping, in LightRFT's order: the rewards are normalized, then
clipped, then the KL penalty and the advantage estimator (with its whitening) run, then the advantages are clipped.

The normalizing statistics are ROLL's choice (algorithm.reward_norm): the step's rewards over every data-parallel
rank (`batch`), each prompt's group of responses (`group`, on the rank that holds it), or running moments of every
reward seen so far (`running`: Welford's, merged with each step's moments over the ranks, checkpointed). Rewards are
divided by the standard deviation (population), after subtracting the mean with `minus_mean` (with ROLL's
`reward_shift`, the mean is subtracted and nothing divided); where the deviation is zero (every reward equal) the
scale is left as it is.
"""

import math
from dataclasses import dataclass

import torch

from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum
from fsdptrain.rl.rollout.base import Generation

FLAT = 1e-8  # a deviation below this is no spread: the rewards are not scaled


@dataclass
class RunningMoments:
    """Count, mean and sum of squared deviations (M2) of every value merged so far."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def merge(self, count: float, mean: float, m2: float) -> None:
        """Add a batch's moments (Chan et al.'s pairwise combination)."""
        total = self.count + count
        if total == 0:
            return
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.count * count / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


def batch_moments(values: torch.Tensor, parallel: Parallel) -> tuple[float, float, float]:
    """Count, mean and M2 of `values` over every data-parallel rank (two reductions, so that the mean is exact
    before the deviations are summed)."""
    count, total = all_reduce_sum([float(values.numel()), float(values.double().sum())], parallel.device, parallel.dp_group)
    mean = total / max(count, 1.0)
    (m2,) = all_reduce_sum([float(((values.double() - mean) ** 2).sum())], parallel.device, parallel.dp_group)
    return count, mean, m2


def scaled(values: torch.Tensor, mean: torch.Tensor | float, std: torch.Tensor | float, minus_mean: bool, divide: bool) -> torch.Tensor:
    centered = values - mean if minus_mean else values
    if not divide:
        return centered
    std = torch.as_tensor(std, dtype=values.dtype)
    return centered / torch.where(std > FLAT, std, torch.ones_like(std))


@dataclass(frozen=True)
class ShapingSettings:
    """algorithm.reward_norm / reward_norm_minus_mean / reward_shift / reward_clip, as RewardShaping applies them."""

    norm: str | None
    minus_mean: bool
    divide: bool  # by the std (all but ROLL's reward_shift, which only subtracts the mean)
    clip: float | None


@dataclass
class RewardShaping:
    """algorithm.reward_norm / reward_norm_minus_mean / reward_shift / reward_clip: the sequence rewards a step trains on, from its
    scores; `running` holds the running moments (checkpointed with the run's state)."""

    settings: ShapingSettings
    running: RunningMoments

    def __call__(self, scores: torch.Tensor, group_ids: torch.Tensor, parallel: Parallel) -> tuple[torch.Tensor, dict[str, float]]:
        """This rank's rewards (each response's group in `group_ids`) normalized and clipped, with the metrics."""
        rewards, metrics, settings = scores.double(), {}, self.settings
        if settings.norm == "batch":
            count, mean, m2 = batch_moments(rewards, parallel)
            rewards = scaled(rewards, mean, math.sqrt(m2 / max(count, 1.0)), settings.minus_mean, settings.divide)
        elif settings.norm == "group":
            normalized = torch.empty_like(rewards)
            for group in group_ids.unique():
                members = rewards[group_ids == group]
                normalized[group_ids == group] = scaled(members, members.mean(), members.std(unbiased=False), settings.minus_mean, settings.divide)
            rewards = normalized
        elif settings.norm == "running":
            self.running.merge(*batch_moments(rewards, parallel))
            rewards = scaled(rewards, self.running.mean, self.running.std, settings.minus_mean, settings.divide)
            metrics.update({"critic/reward_running_mean": self.running.mean, "critic/reward_running_std": self.running.std})
        if settings.clip is not None:
            clipped, count = all_reduce_sum([float((rewards.abs() > settings.clip).sum()), float(rewards.numel())], parallel.device, parallel.dp_group)
            metrics["critic/reward_clip_frac"] = clipped / max(count, 1.0)
            rewards = rewards.clamp(-settings.clip, settings.clip)
        return rewards.to(scores.dtype), metrics

    def state_dict(self) -> dict[str, float]:
        return self.running.state_dict()

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.running.load_state_dict(state)


def clip_advantages(advantages: list[torch.Tensor], generations: list[Generation], clip: float, parallel: Parallel) -> dict[str, float]:
    """Clip each response's token advantages to [-clip, clip] in place; the clipped share of the response tokens."""
    clipped, tokens = 0.0, 0.0
    for advantage, generation in zip(advantages, generations):
        trained = generation.mask > 0
        clipped += float((advantage[trained].abs() > clip).sum())
        tokens += float(trained.sum())
        advantage.clamp_(-clip, clip)
    clipped, tokens = all_reduce_sum([clipped, tokens], parallel.device, parallel.dp_group)
    return {"critic/advantage_clip_frac": clipped / max(tokens, 1.0)}
