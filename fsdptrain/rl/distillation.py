"""On-policy distillation (verl 0.9.1's trainer/distillation, its `distillation.*` keys): a frozen teacher scores
every token the policy sampled, and the policy learns from its divergence to the teacher, token by token.

- A one-sample estimator (`loss_mode` k1, k3, ...): the teacher's log-prob of the sampled token against the
  policy's, as the KL loss estimates the KL to the reference (core_algos.kl_penalty).
- forward_kl_topk: at each position the teacher's k most likely tokens; the KL from the teacher to the policy over
  them, sum_k p(k) (log p(k) - log pi(k)), floored at 0 (the two top-k masses do not sum to 1).

Each token's loss, clamped to [-loss_max_clamp, loss_max_clamp], is aggregated as the actor's other terms and
backpropagated, or with use_policy_gradient its negation is the advantage of PPO's clipped loss with the section's
own clip ratios (the ratio against the old policy). With use_task_rewards the task's policy loss stays and this
one is added times distillation_loss_coef; without, it is the whole loss: verl then drops the policy loss with its
entropy and KL terms.

The teacher and its scoring of the samples are rl/teacher.py's.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fsdptrain.rl import core_algos

TEACHER_LOG_PROB = "teacher_log_prob"  # the sampled token's, for an estimator
TEACHER_TOPK_LOG_PROBS, TEACHER_TOPK_IDS = "teacher_topk_log_probs", "teacher_topk_ids"  # (length, k) each, for forward_kl_topk


@dataclass(frozen=True)
class DistillationSettings:
    """distillation.distillation_loss.*, resolved."""

    loss_mode: str  # forward_kl_topk, or a name in core_algos.KL_ESTIMATORS
    topk: int
    use_task_rewards: bool
    coef: float  # distillation_loss_coef
    loss_max_clamp: float | None
    log_prob_min_clamp: float | None
    use_policy_gradient: bool
    policy: core_algos.PolicyLossSettings  # the clipped loss's ratios under use_policy_gradient (verl's vanilla, clip_ratio_c 3)

    @property
    def uses_topk(self) -> bool:
        return self.loss_mode == "forward_kl_topk"

    @property
    def weight(self) -> float:
        """The distillation loss's weight in the actor's loss: distillation_loss_coef beside the task's loss, else 1."""
        return self.coef if self.use_task_rewards else 1.0


def forward_kl_topk(student: torch.Tensor, teacher: torch.Tensor, log_prob_min_clamp: float | None) -> tuple[torch.Tensor, ...]:
    """At each position, from the policy's and the teacher's log-probs of the teacher's top-k tokens ((T, k) each):
    KL(teacher || policy) over them floored at 0, and the policy's and the teacher's probability mass on them."""
    student_mass, teacher_mass = student.exp().sum(-1), teacher.exp().sum(-1)
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    divergence = (teacher.exp() * (teacher - student)).sum(-1)
    return divergence.clamp_min(0.0), student_mass, teacher_mass


def token_losses(settings: DistillationSettings, log_probs: torch.Tensor, student_topk: torch.Tensor | None, targets: dict[str, torch.Tensor],
                 sums: dict[str, float], mask: torch.Tensor) -> torch.Tensor:
    """Each token's distillation loss, clamped (settings.loss_max_clamp); its metrics' per-token sums added to `sums`."""
    if settings.uses_topk:
        losses, student_mass, teacher_mass = forward_kl_topk(student_topk, targets[TEACHER_TOPK_LOG_PROBS], settings.log_prob_min_clamp)
        add(sums, "distillation/student_mass", student_mass, mask)
        add(sums, "distillation/teacher_mass", teacher_mass, mask)
    else:
        losses = core_algos.kl_penalty(log_probs, targets[TEACHER_LOG_PROB], settings.loss_mode)
        add(sums, "distillation/abs_loss", losses.abs(), mask)
    if settings.loss_max_clamp is not None:  # both ways: k1 is negative where the policy is less likely than the teacher
        losses = losses.clamp(-settings.loss_max_clamp, settings.loss_max_clamp)
    add(sums, "distillation/loss", losses, mask)
    return losses


def add(sums: dict[str, float], key: str, values: torch.Tensor, mask: torch.Tensor) -> None:
    sums[key] = sums.get(key, 0.0) + float((values.detach() * mask).sum())


def distillation_loss(settings: DistillationSettings, tokens: core_algos.PolicyTokens, student_topk: torch.Tensor | None,
                      targets: dict[str, torch.Tensor], per_token: Callable[[torch.Tensor], torch.Tensor], sums: dict[str, float]) -> torch.Tensor:
    """This micro-batch's distillation loss, aggregated by `per_token` (the actor's aggregation over the mini-batch),
    before its weight: the token losses themselves, or as advantages of the clipped policy loss (use_policy_gradient),
    times rollout correction's IS weights where the samples carry them, as verl's."""
    losses = token_losses(settings, tokens.log_probs, student_topk, targets, sums, tokens.mask)
    if not settings.use_policy_gradient:
        return per_token(losses)
    pg, clipped, _ = core_algos.vanilla_policy_loss(replace(tokens, advantages=-losses.detach()), settings.policy)
    if "rollout_is_weight" in targets:
        pg = pg * targets["rollout_is_weight"]
    sums["distillation/pg_clipfrac"] = sums.get("distillation/pg_clipfrac", 0.0) + float(clipped.sum())
    return per_token(pg)
