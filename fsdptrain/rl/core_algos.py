"""The GRPO family's formulas as pure tensor functions, with verl's names and definitions (verl's core_algos):
advantage estimators, policy losses, KL estimators and the one aggregation they all go through.

Per-token tensors are flat, (tokens,), as a packed micro-batch holds them, with a 0/1 `mask` over the response
tokens the policy produced; a (sequences, tokens) matrix is the same thing flattened. What a formula needs of a
whole sequence (its token count, GSPO's mean log-ratio) comes in per token, so that the formulas hold on any
slice of a batch.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fsdptrain.registry import Registry


@dataclass(frozen=True)
class EstimatorInfo:
    """An advantage estimator's declaration: what the run builds for it. The plan derives the critic, the greedy
    rollout, the old-policy pass's sums of squared probabilities, the per-source scores and n's floor from these,
    and nothing from the estimator's name. Every estimator maps an EstimatorBatch to per-token (advantages,
    returns)."""

    needs_values: bool = False  # a critic, whose values it reads (EstimatorBatch.values)
    needs_greedy_baseline: bool = False  # each prompt answered greedily too, its score the baseline (greedy_scores)
    needs_old_log_probs: bool = False  # the old policy's log-probs before the update (so its pass runs, not folded into the update's first)
    needs_sum_pi_squared: bool = False  # the old-policy pass keeps each token's sum of squared probabilities (and so runs: not under bypass)
    needs_source_scores: bool = False  # each reward source's own score: what changes the summed reward token by token is not one of them
    min_group_size: int = 1  # responses a prompt at least (actor_rollout_ref.rollout.n)
    whitened: bool = False  # whitened afterwards over the whole batch's tokens (every rank's)
    batch_scaled: bool = False  # reads EstimatorBatch.batch_scale
    sequence_weights: bool = False  # its advantage weighs a response's summed log-prob: a per-response token mean (seq-mean-token-mean) would reweigh it


@dataclass(frozen=True)
class LossInfo:
    """A policy loss's declaration; every loss maps (PolicyTokens, PolicyLossSettings) to (per-token loss, clipped
    mask, lower-clipped mask)."""

    agg_mode: str | None = None  # the aggregation it always takes (None: loss_agg_mode's)
    batch_local: bool = False  # reads statistics of its micro-batch (its gradient depends on the split)
    old_from_rollout: bool = False  # its old log-probs are the rollout engine's
    sequence_is_weight: bool = False  # rollout correction weighs each sequence by the geometric mean of its tokens' IS weights
    every_row: bool = False  # averages over every sequence of the mini-batch, those without a loss token too (loss_rows)


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", default_info=EstimatorInfo())
POLICY_LOSSES: Registry = Registry("policy loss", default_info=LossInfo())
# Each mode: (masked per-token loss, sequence_tokens, global tokens, global sequences, Dr. GRPO's norm) -> scalar.
LOSS_AGG_MODES: Registry = Registry("loss aggregation mode")
# Each estimator: (log_probs, ref_log_probs) -> per-token KL estimates; a name may take a `+` suffix.
KL_ESTIMATORS: Registry = Registry("KL estimator")


# ---- advantages -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EstimatorBatch:
    """What every estimator reads, as verl's estimators take it: one rank's responses right-padded to the longest,
    (responses, tokens), with each one's prompt group and algorithm.*'s settings. The optional fields are filled
    where the estimator's declaration asks for them (the importance weights where rollout correction makes them)."""

    token_rewards: torch.Tensor  # (B, T): a response's score on its last token, less verl's KL penalty in the reward
    mask: torch.Tensor  # (B, T): 1 on the tokens the policy produced
    group_ids: torch.Tensor  # (B,): the prompt each response answers
    norm_by_std: bool = True  # algorithm.norm_adv_by_std_in_grpo
    gamma: float = 1.0
    lam: float = 1.0
    batch_scale: float = 1.0  # GPG's alpha: the batch's responses over those scored nonzero (every rank's)
    values: torch.Tensor | None = None  # (B, T): the critic's
    greedy_scores: torch.Tensor | None = None  # (B,): the score of the greedy response to each response's prompt
    old_log_probs: torch.Tensor | None = None  # (B, T)
    sum_pi_squared: torch.Tensor | None = None  # (B, T): the old policy's sum over the vocabulary of pi^2
    is_weights: torch.Tensor | None = None  # (B, T): the rollout correction's importance weights
    source_scores: torch.Tensor | None = None  # (B, S): each reward source's own score
    source_weights: torch.Tensor | None = None  # (S,)
    eps: float = 1e-6

    def group_estimate(self, rule: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A group estimator's (advantages, returns): `rule` maps one group's scores (the summed token rewards, or
        `scores`) and its responses' token counts to their advantages, each put on every token of its response."""
        scores = self.token_rewards.sum(-1) if scores is None else scores
        lengths = self.mask.sum(-1).to(scores.dtype)
        per_sequence = torch.empty_like(scores)
        for group in self.group_ids.unique():
            members = self.group_ids == group
            per_sequence[members] = rule(scores[members], lengths[members])
        advantages = per_sequence[:, None] * self.mask
        return advantages, advantages


GROUP = EstimatorInfo(min_group_size=2)  # compares a prompt's responses


def group_mean_std(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's mean and Bessel std; a one-sample group has mean 0 and std 1, as verl's."""
    if len(scores) > 1:
        return scores.mean(), scores.std()
    return torch.zeros((), dtype=scores.dtype), torch.ones((), dtype=scores.dtype)


def normalized(scores: torch.Tensor, norm_by_std: bool, eps: float) -> torch.Tensor:
    """(s - mean) / (std + eps) with Bessel's std (norm_by_std), else s - mean (Dr. GRPO)."""
    mean, std = group_mean_std(scores)
    return (scores - mean) / (std + eps) if norm_by_std else scores - mean


@ADVANTAGE_ESTIMATORS.register("grpo", "grpo_vectorized", info=GROUP)
def grpo_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each score normalized within its group (`normalized`)."""
    return batch.group_estimate(lambda scores, _: normalized(scores, batch.norm_by_std, batch.eps))


@ADVANTAGE_ESTIMATORS.register("rloo", info=GROUP)
def rloo_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """n / (n - 1) (s - mean): the leave-one-out baseline; a lone sample keeps its score, as verl's loop."""
    return batch.group_estimate(lambda s, _: (s - s.mean()) * len(s) / (len(s) - 1) if len(s) > 1 else s.clone())


@ADVANTAGE_ESTIMATORS.register("rloo_vectorized", info=GROUP)
def rloo_vectorized_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO as verl's vectorized form: the same, but a lone sample gets 0."""
    return batch.group_estimate(lambda s, _: (s - s.mean()) * len(s) / (len(s) - 1) if len(s) > 1 else torch.zeros_like(s))


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline", info=EstimatorInfo(min_group_size=2, whitened=True))
def reinforce_plus_plus_baseline_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """s - mean (REINFORCE++ with a group baseline; the batch whitening follows, over every rank)."""
    return batch.group_estimate(lambda s, _: s - group_mean_std(s)[0])


@ADVANTAGE_ESTIMATORS.register("opo", info=GROUP)
def opo_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: s minus the length-weighted mean of the group's scores, sum(len s) / sum(len), the baseline that is
    optimal for a sequence-level reward."""
    return batch.group_estimate(lambda s, lengths: s - (lengths * s).sum() / lengths.sum() if len(s) > 1 else s.clone())


@ADVANTAGE_ESTIMATORS.register("grpo_passk", info=GROUP)
def passk_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training: only the group's best response gets an advantage, its margin over the second best
    (divided by the group's std + eps with norm_by_std); every other response gets 0."""

    def best_only(scores: torch.Tensor, _) -> torch.Tensor:
        top, index = torch.topk(scores, 2)
        advantages = torch.zeros_like(scores)
        advantages[index[0]] = (top[0] - top[1]) / (scores.std() + batch.eps) if batch.norm_by_std else top[0] - top[1]
        return advantages

    return batch.group_estimate(best_only)


@ADVANTAGE_ESTIMATORS.register("gpg", info=EstimatorInfo(min_group_size=2, batch_scaled=True))
def gpg_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: alpha (s - mean), alpha the batch's responses over those scored nonzero (batch_scale)."""
    return batch.group_estimate(lambda s, _: batch.batch_scale * (s - group_mean_std(s)[0]))


@ADVANTAGE_ESTIMATORS.register("gdpo", info=EstimatorInfo(needs_source_scores=True, min_group_size=2, whitened=True))
def gdpo_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: each reward source's scores (columns of source_scores) normalized within each group as GRPO's, then
    summed with the sources' weights (the batch whitening follows)."""
    advantages = torch.zeros_like(batch.token_rewards)
    for column, weight in zip(batch.source_scores.T, batch.source_weights):
        advantages += weight * batch.group_estimate(lambda scores, _: normalized(scores, batch.norm_by_std, batch.eps), column)[0]
    return advantages, advantages


def reward_to_go(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Undiscounted sum of the masked rewards from each position to the end of its response (the last dim)."""
    return (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)


def path_variance_baseline(returns: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """The optimal token baseline of one group's aligned trajectories (N, T): at each position t,
    sum_i G_it W_it / sum_i W_it over the trajectories that reach t, W the cumulative path variance; 0 for a group
    of one, and 0 on the tail of a unique longest trajectory beyond the second longest (no other trajectory
    estimates it there)."""
    if len(returns) == 1:
        return torch.zeros_like(returns)
    baseline = ((returns * weights * mask).sum(0) / ((weights * mask).sum(0) + eps)).expand_as(returns).clone()
    lengths = mask.sum(1)
    longest, second = torch.sort(lengths).values[-2:].long().tolist()[::-1]
    if int((lengths == longest).sum()) == 1 and longest > second:
        baseline[int(lengths.argmax()), second:] = 0
    return baseline


def optimal_token_group(token_rewards: torch.Tensor, mask: torch.Tensor, old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                        is_weights: torch.Tensor | None, compact: bool, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline over one group's responses (N, T), right-padded: each token's reward-to-go G_t
    minus B_t = E[G_t W_t] / E[W_t], W_t the sum up to t of the score function's squared norm proxy
    1 - 2 pi_t + sum_v pi_v^2 (times the squared rollout importance weight where given). `compact`
    (tir_optimal_token_baseline, multi-turn): the trained tokens of each trajectory are aligned by their count,
    not their position, so that a tool's tokens shift nothing. Returns (advantages, returns)."""
    returns = reward_to_go(token_rewards, mask)
    per_token = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    if is_weights is not None:
        per_token = per_token * is_weights.square()
    path = (per_token * mask).cumsum(-1)
    if not compact:
        return (returns - path_variance_baseline(returns, path, mask, eps)) * mask, returns
    trained = mask > 0
    keep = trained.any(1)  # a trajectory without trained tokens takes no part in its group's baseline
    lengths = trained.sum(1)
    width = int(lengths.max()) if len(lengths) else 0
    aligned_mask = (torch.arange(width)[None] < lengths[:, None]).to(mask.dtype)
    aligned_returns, aligned_path = torch.zeros(len(mask), width, dtype=returns.dtype), torch.zeros(len(mask), width, dtype=path.dtype)
    aligned_returns[aligned_mask > 0], aligned_path[aligned_mask > 0] = returns[trained], path[trained]
    baseline = torch.zeros_like(aligned_returns)
    baseline[keep] = path_variance_baseline(aligned_returns[keep], aligned_path[keep], aligned_mask[keep], eps)
    advantages = torch.zeros_like(returns)
    advantages[trained] = (aligned_returns - baseline)[aligned_mask > 0]
    return advantages, returns


def optimal_token_estimate(batch: EstimatorBatch, compact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`optimal_token_group` over each group of the batch."""
    advantages, returns = torch.zeros_like(batch.token_rewards), torch.zeros_like(batch.token_rewards)
    for group in batch.group_ids.unique():
        rows = batch.group_ids == group
        advantages[rows], returns[rows] = optimal_token_group(
            batch.token_rewards[rows], batch.mask[rows], batch.old_log_probs[rows], batch.sum_pi_squared[rows],
            None if batch.is_weights is None else batch.is_weights[rows], compact)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("optimal_token_baseline", info=EstimatorInfo(needs_old_log_probs=True, needs_sum_pi_squared=True))
def optimal_token_baseline_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline, tokens aligned by position."""
    return optimal_token_estimate(batch, compact=False)


@ADVANTAGE_ESTIMATORS.register("tir_optimal_token_baseline", info=EstimatorInfo(needs_old_log_probs=True, needs_sum_pi_squared=True))
def tir_optimal_token_baseline_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline of multi-turn trajectories, trained tokens aligned by their count."""
    return optimal_token_estimate(batch, compact=True)


@ADVANTAGE_ESTIMATORS.register("beam_pg", info=EstimatorInfo(needs_old_log_probs=True, min_group_size=2, sequence_weights=True))
def beam_pg_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of the expected reward over each prompt's set of responses (its beams), the set's
    distribution pi~ being the responses' probabilities renormalized over it (a softmax of their summed old
    log-probs): each response's advantage pi~_k (r_k - sum_j pi~_j r_j) on every token, so that
    sum_k A_k grad log pi(y_k) = grad E_pi~[r]. A group-normalized advantage over a deterministic top-k is not a
    gradient: sum_k grad log pi(y_k) is not 0 on the set, and its mean baseline drains the set into the tail."""
    scores, sequence_log_probs = batch.token_rewards.sum(-1), (batch.old_log_probs * batch.mask).sum(-1)
    per_sequence = torch.empty_like(scores)
    for group in batch.group_ids.unique():
        members = batch.group_ids == group
        weights = sequence_log_probs[members].softmax(0)
        per_sequence[members] = weights * (scores[members] - (weights * scores[members]).sum())
    advantages = per_sequence[:, None] * batch.mask
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("remax", info=EstimatorInfo(needs_greedy_baseline=True))
def remax_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: each response's reward-to-go minus the score of its prompt's greedy response."""
    returns = reward_to_go(batch.token_rewards, batch.mask)
    return returns - batch.greedy_scores[:, None] * batch.mask, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus", info=EstimatorInfo(whitened=True))
def reinforce_plus_plus_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: each token's discounted return, sum of gamma^k r_{t+k} over the generated tokens (mask 1), as
    its advantage (the batch whitening follows). Tokens off the mask (a tool's, an environment's) are skipped, not
    a reset: verl's reset there would cut a multi-turn trajectory's final reward off from every turn before its
    last tool call."""
    rewards, mask = batch.token_rewards, batch.mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[:-1], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(mask[..., t] > 0, rewards[..., t] + batch.gamma * running, running)
        returns[..., t] = running
    returns = returns * mask
    return returns, returns


@ADVANTAGE_ESTIMATORS.register("gae", info=EstimatorInfo(needs_values=True, whitened=True))
def gae_advantages(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation, as verl's compute_gae_advantage_return (before its whitening):
    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, returns A + V. Tokens off the mask (a
    tool's, an environment's) are skipped, not reset: they pass the next token's value and advantage through
    unchanged, so that a turn's advantage reaches across them."""
    rewards, values, mask = batch.token_rewards, batch.values, batch.mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[:-1], dtype=values.dtype)
    next_advantage = torch.zeros(rewards.shape[:-1], dtype=values.dtype)
    for t in reversed(range(rewards.shape[-1])):
        advantage = rewards[..., t] + batch.gamma * next_value - values[..., t] + batch.gamma * batch.lam * next_advantage
        generated = mask[..., t] > 0
        next_value = torch.where(generated, values[..., t], next_value)
        next_advantage = torch.where(generated, advantage, next_advantage)
        advantages[..., t] = next_advantage
    return advantages, advantages + values


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, mean: float, variance: float, eps: float = 1e-8) -> torch.Tensor:
    """(v - mean) / sqrt(variance + eps) on the masked tokens, with the whole batch's mean and Bessel-corrected
    variance (so that every rank whitens with the same statistics; `batch_moments` computes them), in fp64: verl's
    masked_whiten. Equal values give 0, not NaN."""
    whitened = (values.double() - mean) * (variance + eps) ** -0.5
    return (whitened * mask).to(values.dtype)


def batch_moments(values: torch.Tensor, mask: torch.Tensor, sum_over_ranks: Callable[[list[float]], list[float]]) -> tuple[float, float]:
    """The mean and Bessel-corrected variance of the masked `values`, summed over the ranks by `sum_over_ranks`,
    in two passes in fp64: one pass (the sum of squares less count x mean²) loses the variance when the spread is
    small next to the mean, and can make it negative where every value is equal."""
    values, mask = values.double(), mask.double()
    total, count = sum_over_ranks([float((values * mask).sum()), float(mask.sum())])
    mean = total / max(count, 1.0)
    (squares,) = sum_over_ranks([float(((values - mean).square() * mask).sum())])
    return mean, squares / max(count - 1.0, 1.0)


# ---- aggregation -----------------------------------------------------------------------------------------------
def sequence_sums(values: torch.Tensor, sequences: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """(num_sequences,) sums of per-token `values` by each token's sequence index."""
    return torch.zeros(num_sequences, dtype=values.dtype, device=values.device).index_add(0, sequences, values)


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, sequence_tokens: torch.Tensor, mode: str, global_tokens: float,
             global_sequences: float, max_response_length: int, loss_scale_factor: float | None = None) -> torch.Tensor:
    """This rank's share of a mini-batch's loss from its per-token losses, over the mini-batch's global counts
    (every DP rank, every micro-batch), so that the gradient is the same whatever the split. `sequence_tokens`
    holds, on each token, the number of response tokens of its whole sequence: with it each mode is a plain sum
    over tokens, which any split of the sequences or of their tokens (Ulysses slices) adds back up.

    token-mean: sum over all tokens / global token count. token-sum: the sum over all tokens. seq-mean-token-sum:
    per-sequence token sums, averaged over global sequences. seq-mean-token-mean: per-sequence token means, averaged likewise.
    seq-mean-token-sum-norm: token sums / (loss_scale_factor or max_response_length), averaged over sequences
    (Dr. GRPO)."""
    return LOSS_AGG_MODES[mode](loss * mask, sequence_tokens, global_tokens, global_sequences, loss_scale_factor or max_response_length)


@LOSS_AGG_MODES.register("token-mean")
def token_mean(masked: torch.Tensor, sequence_tokens: torch.Tensor, tokens: float, sequences: float, norm: float) -> torch.Tensor:
    return masked.sum() / max(tokens, 1.0)


@LOSS_AGG_MODES.register("token-sum")
def token_sum(masked: torch.Tensor, sequence_tokens: torch.Tensor, tokens: float, sequences: float, norm: float) -> torch.Tensor:
    return masked.sum()


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(masked: torch.Tensor, sequence_tokens: torch.Tensor, tokens: float, sequences: float, norm: float) -> torch.Tensor:
    return masked.sum() / max(sequences, 1.0)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(masked: torch.Tensor, sequence_tokens: torch.Tensor, tokens: float, sequences: float, norm: float) -> torch.Tensor:
    return (masked / sequence_tokens.clamp(min=1)).sum() / max(sequences, 1.0)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(masked: torch.Tensor, sequence_tokens: torch.Tensor, tokens: float, sequences: float, norm: float) -> torch.Tensor:
    return masked.sum() / norm / max(sequences, 1.0)


# ---- policy losses ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyLossSettings:
    """Every policy loss's knobs (actor_rollout_ref.actor.*, verl's names and defaults); each loss reads its own."""

    clip_low: float = 0.2  # clip_ratio_low (DPPO: the divergence threshold; CPGD: on the log-ratio)
    clip_high: float = 0.2  # clip_ratio_high
    clip_c: float = 3.0  # clip_ratio_c: the dual clip; DPPO's truncation of its ratio
    tau_pos: float = 1.0  # SAPO's gate temperatures, where the advantage is positive / not
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002  # policy_loss.*: Clip-Cov, KL-Cov, DRO
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    policy_drift_coef: float = 0.01  # CPGD's
    bypass_loss_type: str = "ppo_clip"  # algorithm.rollout_correction.loss_type, under loss_mode bypass_mode
    rollout_is: str | None = None  # bypass_mode's reinforce weights: their level and cap (with a lower bound: IcePop's bounds)
    rollout_is_threshold: float = 2.0
    rollout_is_lower: float | None = None
    rollout_is_batch_normalize: bool = False  # bypass_mode: the weights over their mean in the micro-batch, every rank's
    rejection: "tuple[RejectionRule, ...]" = ()  # bypass_mode: rollout_rs against the current policy, in each micro-batch


@dataclass(frozen=True)
class PolicyTokens:
    """One micro-batch's response tokens as a policy loss sees them, flat. `sequence_mean` maps per-token values
    (detached) to, on each token, their mean over its sequence's response tokens, wherever its slices lie."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    sequence_mean: Callable[[torch.Tensor], torch.Tensor]
    sequence_tokens: torch.Tensor  # on each token, its sequence's count of response tokens
    sequence_max: Callable[[torch.Tensor], torch.Tensor] | None = None  # on each token, its sequence's maximum of the values
    ranks_sum: Callable[[torch.Tensor], torch.Tensor] | None = None  # a sum over every training rank's micro-batch

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """On each token, the sum of `values` over its sequence's response tokens."""
        return self.sequence_mean(values) * self.sequence_tokens


def log_ratio(tokens: PolicyTokens) -> torch.Tensor:
    """log(pi / pi_old) per token, clamped to [-20, 20] as verl's."""
    return (tokens.log_probs - tokens.old_log_probs).clamp(-20.0, 20.0)


def is_weighted(loss: torch.Tensor, weights: torch.Tensor, loss_mode: str, tokens: PolicyTokens) -> torch.Tensor:
    """A policy loss times rollout correction's IS weights: token by token, or, for a loss of whole sequences
    (GMPO), by each sequence's geometric mean of its tokens' weights, as verl's."""
    if POLICY_LOSSES.info[loss_mode].sequence_is_weight:
        weights = torch.exp(tokens.sequence_mean(torch.log(weights + 1e-10)))
    return loss * weights


def loss_rows(has_loss_tokens: Sequence[bool], loss_mode: str) -> float:
    """The sequences a policy loss averages over: those with a loss token, or all of them for a loss that counts
    every row (GMPO: verl's torch.mean over the batch's rows, where mask_truncated_completions empties some)."""
    return float(len(has_loss_tokens)) if POLICY_LOSSES.info[loss_mode].every_row else float(sum(has_loss_tokens))


def on_sequence(value: torch.Tensor, per_token_term: torch.Tensor, tokens: PolicyTokens) -> torch.Tensor:
    """A per-sequence loss `value` (detached, on each token) spread over its tokens so that their sum is the
    value and each token's gradient is that of its own `per_token_term` times the value: d value / d term_t when
    value = f(mean_t term_t) with f' = f. Exact under any split of a sequence over micro-batches or slices."""
    return value * (1 + per_token_term - per_token_term.detach()) / tokens.sequence_tokens.clamp(min=1)


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """PPO's clipped surrogate with dual clip: per-token loss max(-A r, -A clip(r, 1-low, 1+high)), and for A < 0
    at most -A c. Returns (per-token loss, clipped mask, lower-clipped mask)."""
    advantages, mask = tokens.advantages, tokens.mask
    ratio = torch.exp(log_ratio(tokens))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = -advantages * settings.clip_c
    lower = (loss > dual) & (advantages < 0)
    loss = torch.where(advantages < 0, torch.minimum(loss, dual), loss)
    return loss, (clipped > unclipped).float() * mask, lower.float() * mask


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """GSPO: the sequence-level ratio s_i = exp(mean log(pi / pi_old) over the response, detached) carried to each
    token as s_i exp(logp_t - sg[logp_t]); two-sided clip, no dual clip."""
    log_probs, advantages = tokens.log_probs, tokens.advantages
    sequence_log_ratio = tokens.sequence_mean((log_probs - tokens.old_log_probs).detach())
    ratio = torch.exp((sequence_log_ratio + log_probs - log_probs.detach()).clamp(max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float() * tokens.mask, torch.zeros_like(tokens.mask)


@POLICY_LOSSES.register("sapo", info=LossInfo(agg_mode="seq-mean-token-mean"))
def sapo_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """SAPO: a smooth gate instead of the clip, -A (4 / tau) sigmoid(tau (r - 1)), tau_pos where A > 0 else
    tau_neg; always averaged per sequence first (seq-mean-token-mean), as verl's."""
    tau = torch.where(tokens.advantages > 0, settings.tau_pos, settings.tau_neg).to(tokens.log_probs.dtype)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio(tokens)) - 1)) * (4 / tau)
    return -gate * tokens.advantages, torch.zeros_like(tokens.mask), torch.zeros_like(tokens.mask)


@POLICY_LOSSES.register("gpg")
def gpg_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """GPG: the plain policy gradient -A log pi, no ratio."""
    return -tokens.log_probs * tokens.advantages, torch.zeros_like(tokens.mask), torch.zeros_like(tokens.mask)


def covariance(tokens: PolicyTokens) -> torch.Tensor:
    """Per token, (A - mean A) (logp - mean logp) with the micro-batch's means over its response tokens."""
    mask = tokens.mask
    count = mask.sum().clamp(min=1)
    log_probs = tokens.log_probs.detach()
    return (tokens.advantages - (tokens.advantages * mask).sum() / count) * (log_probs - (log_probs * mask).sum() / count)


@POLICY_LOSSES.register("clip_cov", info=LossInfo(batch_local=True))
def clip_cov_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """Clip-Cov: PPO's clipped surrogate (no dual clip) with the gradient cut from a random clip_cov_ratio of the
    micro-batch's tokens whose advantage-logp covariance lies in (clip_cov_lb, clip_cov_ub), among those the clip
    left alone (verl's draw: torch's global generator)."""
    advantages, mask = tokens.advantages, tokens.mask
    ratio = torch.exp(tokens.log_probs - tokens.old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    by_clip = (clipped > unclipped) & (mask > 0)
    cov = covariance(tokens)
    candidates = ((cov < settings.clip_cov_ub) & (cov > settings.clip_cov_lb) & (mask > 0) & ~by_clip).nonzero().flatten()
    keep = torch.ones_like(mask)
    if len(candidates):
        count = max(int(settings.clip_cov_ratio * mask.sum().item()), 1)
        keep[candidates[torch.randperm(len(candidates))[:count]]] = 0
    return torch.maximum(unclipped, clipped) * keep, (keep == 0).float() * mask, torch.zeros_like(mask)


@POLICY_LOSSES.register("kl_cov", info=LossInfo(batch_local=True))
def kl_cov_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """KL-Cov: the unclipped surrogate -A r, plus ppo_kl_coef |log r| on the kl_cov_ratio of the micro-batch's
    tokens with the largest advantage-logp covariance (at least one)."""
    advantages, mask = tokens.advantages, tokens.mask
    log_ratio_ = tokens.log_probs - tokens.old_log_probs
    loss = -advantages * torch.exp(log_ratio_)
    valid = (mask > 0).nonzero().flatten()
    penalized = torch.zeros_like(mask)
    if len(valid):
        advantages_, log_probs = advantages[valid].detach(), tokens.log_probs[valid].detach()
        cov = (advantages_ - advantages_.mean()) * (log_probs - log_probs.mean())
        penalized[valid[torch.topk(cov, max(1, int(len(valid) * settings.kl_cov_ratio))).indices]] = 1
    loss = loss + penalized * settings.ppo_kl_coef * log_ratio_.abs()
    return loss, penalized * mask, torch.zeros_like(mask)


@POLICY_LOSSES.register("geo_mean", info=LossInfo(agg_mode="seq-mean-token-sum", sequence_is_weight=True, every_row=True))
def geo_mean_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """GMPO: per sequence -A exp(mean_t clip_t(log r_t)), the geometric mean of the token ratios, each log-ratio
    clipped to [-low, high] on the side its advantage's sign pushes; A the sequence's mean advantage; averaged
    over sequences whatever loss_agg_mode says, as verl's."""
    advantages = tokens.advantages
    raw = tokens.log_probs - tokens.old_log_probs
    sign = torch.sign(advantages)
    clipped_log_ratio = sign * torch.minimum(sign * raw, sign * raw.clamp(-settings.clip_low, settings.clip_high))
    advantage = tokens.sequence_mean(advantages)
    value = -advantage * torch.exp(tokens.sequence_mean(clipped_log_ratio.detach()))
    clipped = (raw != raw.clamp(-settings.clip_low, settings.clip_high)).float() * tokens.mask
    return on_sequence(value, clipped_log_ratio, tokens), clipped * (advantages > 0), clipped * (advantages < 0)


@POLICY_LOSSES.register("dro")
def dro_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """DRO: -(A log pi - beta / 2 (log r)^2), a quadratic penalty on the log-ratio (policy_loss.dro_beta)."""
    log_ratio_ = tokens.log_probs - tokens.old_log_probs
    loss = -(tokens.log_probs * tokens.advantages - 0.5 * settings.dro_beta * log_ratio_.square())
    return loss, torch.zeros_like(tokens.mask), torch.zeros_like(tokens.mask)


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """CISPO: -sg(clip(r, 1-low, 1+high)) A log pi: the clipped ratio weighs every token's gradient, none is cut."""
    ratio = torch.exp(log_ratio(tokens))
    clipped_ratio = ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    loss = -clipped_ratio.detach() * tokens.advantages * tokens.log_probs
    return loss, (ratio != clipped_ratio).float() * tokens.mask, torch.zeros_like(tokens.mask)


def dppo_loss(tokens: PolicyTokens, settings: PolicyLossSettings, inside: torch.Tensor):
    """DPPO's loss once its trust region `inside` is known: -A sg(min(r, clip_c)) log pi on the tokens inside."""
    ratio = torch.exp(log_ratio(tokens))
    inside = inside.detach().float()
    loss = -tokens.advantages * ratio.clamp(max=settings.clip_c).detach() * tokens.log_probs * inside
    return loss, (1 - inside) * tokens.mask, (ratio > settings.clip_c).float() * inside * tokens.mask


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """DPPO-Binary-TV: a token trains while pi - pi_old stays within clip_ratio_high (A > 0) or above
    -clip_ratio_low (A <= 0)."""
    change = torch.exp(tokens.log_probs) - torch.exp(tokens.old_log_probs)
    inside = torch.where(tokens.advantages > 0, change <= settings.clip_high, change >= -settings.clip_low)
    return dppo_loss(tokens, settings, inside)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """DPPO-Binary-KL: a token trains while the binary KL between pi_old and pi of its token stays within
    clip_ratio_high (A > 0) or clip_ratio_low (A <= 0), or while pi moves against the advantage's push."""
    prob, old_prob = torch.exp(tokens.log_probs), torch.exp(tokens.old_log_probs)
    binary_kl = old_prob * (tokens.old_log_probs - tokens.log_probs) + (1 - old_prob) * torch.log((1 - old_prob + 1e-8) / (1 - prob + 1e-8))
    inside = torch.where(tokens.advantages > 0, (binary_kl <= settings.clip_high) | (prob <= old_prob),
                         (binary_kl <= settings.clip_low) | (prob >= old_prob))
    return dppo_loss(tokens, settings, inside)


@POLICY_LOSSES.register("bypass_mode", info=LossInfo(old_from_rollout=True))
def bypass_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """verl's rollout-correction bypass: the old log-probs are the rollout engine's (no old-policy pass). loss_type
    ppo_clip: PPO's clipped surrogate against them; reinforce: -A log pi weighted by the truncated importance
    weights sg(pi / pi_rollout) at rollout_is's level (none without it), with rollout_is_batch_normalize over their
    mean in the micro-batch (every rank's, as verl's distributed mean). rollout_rs is the caller's mask
    (bypass_kept)."""
    if settings.bypass_loss_type == "ppo_clip":
        return vanilla_policy_loss(tokens, settings)
    loss = -tokens.advantages * tokens.log_probs
    if settings.rollout_is is not None:
        loss = loss * bypass_is_weights(tokens, settings)
    return loss, torch.zeros_like(tokens.mask), torch.zeros_like(tokens.mask)


def bypass_is_weights(tokens: PolicyTokens, settings: PolicyLossSettings) -> torch.Tensor:
    """verl's compute_rollout_correction_weights against the current policy (rollout_is_weights on a micro-batch's
    flat tokens), normalized to a mean of 1 over every rank's tokens (token) or sequences (sequence)."""
    mask = tokens.mask
    weights, _ = rollout_is_weights(tokens.log_probs.detach(), tokens.old_log_probs, mask, settings.rollout_is, settings.rollout_is_threshold,
                                    settings.rollout_is_lower, tokens.sequence_sum)
    if settings.rollout_is_batch_normalize:
        # a sequence's weight is on each of its tokens: its share 1 / (its tokens) counts it once, wherever its slices lie
        share = mask if settings.rollout_is == "token" else mask / tokens.sequence_tokens.clamp(min=1)
        total, count = tokens.ranks_sum(torch.stack([(weights * share).sum(), share.sum()]))
        mean = total / count.clamp(min=1e-8)
        if mean > 1e-8:
            weights = weights / mean
    return weights


def bypass_kept(tokens: PolicyTokens, settings: PolicyLossSettings) -> torch.Tensor:
    """verl's bypass-mode rejection (rollout_rs) against the current policy: the mask with 0 where a rule rejects a
    token or its sequence, on a micro-batch's flat tokens."""
    return rejection_keep((tokens.log_probs - tokens.old_log_probs).detach(), tokens.mask, settings.rejection, tokens.sequence_sum,
                          tokens.sequence_max)


@POLICY_LOSSES.register("cpgd")
def cpgd_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """CPGD (LightRFT; Liu et al. 2025): the policy gradient on the clipped log-ratio, -min(A log r, A clip(log r,
    log(1-low), log(1+high))), plus policy_drift_coef times the policy drift KL(pi_old || pi), estimated per token
    by r - 1 - log r."""
    advantages = tokens.advantages
    log_ratio_ = log_ratio(tokens)
    clipped_log_ratio = log_ratio_.clamp(math.log(1 - settings.clip_low), math.log(1 + settings.clip_high))
    unclipped, clipped = -advantages * log_ratio_, -advantages * clipped_log_ratio
    drift = torch.exp(log_ratio_) - 1 - log_ratio_
    loss = torch.maximum(unclipped, clipped) + settings.policy_drift_coef * drift
    return loss, (clipped > unclipped).float() * tokens.mask, torch.zeros_like(tokens.mask)


@POLICY_LOSSES.register("topr")
def topr_policy_loss(tokens: PolicyTokens, settings: PolicyLossSettings):
    """TOPR (ROLL; Le Roux et al. 2025): -A log pi, as supervised learning on responses with A >= 0, and weighted
    by the sequence's truncated ratio sg(min(pi(y) / pi_old(y), 1)) on responses with A < 0."""
    sequence_log_ratio = tokens.sequence_sum(log_ratio(tokens).detach())
    weight = torch.where(tokens.advantages < 0, torch.exp(sequence_log_ratio.clamp(max=0.0)), torch.ones_like(tokens.mask))
    lower = ((tokens.advantages < 0) & (sequence_log_ratio < 0)).float() * tokens.mask
    return -tokens.advantages * weight * tokens.log_probs, torch.zeros_like(tokens.mask), lower


# ---- the critic's loss ---------------------------------------------------------------------------------------------
def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's clipped value loss per token, before aggregation: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c)
    - R)^2), the 0.5 that verl applies after aggregating (every mode is linear). Returns (per-token loss, the mask
    of tokens where the clipped term was the larger)."""
    clipped_values = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), (clipped_loss > unclipped_loss).float() * mask


# ---- rollout correction -------------------------------------------------------------------------------------------
def rollout_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, level: str,
                       upper: float, lower: float | None = None,
                       sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights for the gap between the engine that sampled a response and the policy `old_log_probs`
    are of: token, exp(old - rollout) per token; sequence, exp(sum over the response of old - rollout) on every
    token. Capped at `upper` (truncated IS), or with `lower`, zero outside [lower, upper] (IcePop), as verl's. On one
    response (tokens,) by default; on a micro-batch's flat tokens with `sequence_sum` (each token its sequence's sum
    over the mask). Returns (the weights, 0 off the mask; the raw weights)."""
    log_ratio = (old_log_probs - rollout_log_probs) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum().expand_as(mask) if sequence_sum is None else sequence_sum(log_ratio)
    raw = torch.exp(log_ratio.clamp(-20.0, 20.0))
    return bounded(raw, upper, lower) * mask, raw


def bounded(weights: torch.Tensor, upper: float, lower: float | None) -> torch.Tensor:
    """Importance weights capped at `upper` (truncated IS), or with `lower`, zero outside [lower, upper] (IcePop)."""
    return weights.clamp(max=upper) if lower is None else torch.where((weights >= lower) & (weights <= upper), weights, torch.zeros_like(weights))


# Each divergence of rollout_rs, from the log-ratio log(pi_old / pi_rollout): k1 the log-ratio of the engine to the
# old policy, k2 half its square, k3 exp(r) - 1 - r (verl's names)
REJECTION_DIVERGENCES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda r: -r, "k2": lambda r: 0.5 * r.square(), "k3": lambda r: torch.exp(r) - 1.0 - r}


@dataclass(frozen=True)
class RejectionRule:
    """One option of algorithm.rollout_correction.rollout_rs: `level` token, seq_sum, seq_mean or seq_max of the
    divergence `kind`, kept within [low, high] (k1: the logs of its ratio bounds; k2, k3: high alone)."""

    level: str
    kind: str
    low: float | None
    high: float


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, rules: Sequence[RejectionRule],
                   sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   sequence_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """verl's compute_rollout_rejection_mask: `mask` with 0 where a rule rejects the token (a sequence-level rule
    rejects the whole response). On one response (tokens,) by default; on a micro-batch's flat tokens with
    `sequence_sum` and `sequence_max`, which give each token its sequence's sum (over the mask) or maximum."""
    sequence_sum = sequence_sum or (lambda values: (values * mask).sum().expand_as(mask))
    sequence_max = sequence_max or (lambda values: values.max().expand_as(mask))
    r = log_ratio.clamp(-20.0, 20.0)
    keep = mask.clone()
    for rule in rules:
        divergence = REJECTION_DIVERGENCES[rule.kind](r)
        if rule.level == "seq_sum":
            divergence = sequence_sum(divergence * mask)
        elif rule.level == "seq_mean":
            divergence = sequence_sum(divergence * mask) / (sequence_sum(mask) + 1e-8)
        elif rule.level == "seq_max":
            highest = sequence_max(divergence.masked_fill(mask == 0, float("-inf")))
            divergence = torch.where(highest == float("-inf"), torch.zeros_like(highest), highest)
        kept = divergence <= rule.high if rule.low is None else (divergence >= rule.low) & (divergence <= rule.high)
        keep = keep * kept
    return keep


# ---- KL ---------------------------------------------------------------------------------------------------------
def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimates (verl's kl_penalty). kl/k1: logp - ref; abs: |logp - ref|; mse/k2:
    (logp - ref)^2 / 2; low_var_kl/k3: exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]. A `+` suffix
    (e.g. `low_var_kl+`) takes the value of the estimator and the gradient of k2 (straight-through), an unbiased
    gradient of KL."""
    if estimator.endswith("+"):
        value = kl_penalty(log_probs, ref_log_probs, estimator[:-1])
        gradient = kl_penalty(log_probs, ref_log_probs, "k2")
        return gradient + (value - gradient).detach()
    return KL_ESTIMATORS[estimator](log_probs, ref_log_probs)


@KL_ESTIMATORS.register("kl", "k1")
def log_ratio_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("abs")
def abs_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - ref_log_probs).abs()


@KL_ESTIMATORS.register("mse", "k2")
def squared_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def low_var_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    reverse = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (torch.exp(reverse) - reverse - 1).clamp(-10.0, 10.0)


# ---- the KL coefficient of the reward ---------------------------------------------------------------------------
class KLController:
    """The coefficient of the KL penalty in the reward (verl's kl_ctrl): fixed, or adaptive (Ziegler et al.: moved
    toward `target` KL by at most 20% of the error, scaled by n_steps / horizon). Checkpointed with the run."""

    def __init__(self, kind: str, coef: float, target: float, horizon: int):
        self.kind, self.value, self.target, self.horizon = kind, coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]
