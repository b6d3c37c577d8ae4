"""The GRPO family's formulas as pure tensor functions, with verl's names and definitions (verl's core_algos):
advantage estimators, policy losses, KL estimators and the one aggregation they all go through.

Per-token tensors are flat, (tokens,), as a packed micro-batch holds them, with a 0/1 `mask` over the response
tokens the policy produced; a (sequences, tokens) matrix is the same thing flattened. What a formula needs of a
whole sequence (its token count, GSPO's mean log-ratio) comes in per token, so that the formulas hold on any
slice of a batch.
"""

import torch

from fsdptrain.registry import Registry

# Each estimator registers its kind: "group" maps one prompt's scores (n,) to its responses' advantages (scores,
# norm_by_std, eps); "token" one response's per-token rewards and mask to its advantages (token_rewards, mask,
# gamma); "critic" one response's per-token rewards, the critic's values, its mask, gamma and lambda to its
# (advantages, returns). `whitened`: whitened afterwards over the whole batch's tokens (every rank's).
ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
# Each loss: (log_probs, old_log_probs, advantages, mask, sequence_log_ratio, clip_low, clip_high, clip_c) ->
# (per-token loss, clipped mask, lower-clipped mask).
POLICY_LOSSES: Registry = Registry("policy loss")
# Each mode: (masked per-token loss, sequence_tokens, global tokens, global sequences, Dr. GRPO's norm) -> scalar.
LOSS_AGG_MODES: Registry = Registry("loss aggregation mode")
# Each estimator: (log_probs, ref_log_probs) -> per-token KL estimates; a name may take a `+` suffix.
KL_ESTIMATORS: Registry = Registry("KL estimator")


# ---- advantages -----------------------------------------------------------------------------------------------
# A one-sample group has mean 0 (and, for grpo, std 1).
@ADVANTAGE_ESTIMATORS.register("grpo", kind="group")
def grpo_advantages(scores: torch.Tensor, norm_by_std: bool, eps: float) -> torch.Tensor:
    """(s - mean) / (std + eps) with Bessel's std (norm_by_std), else s - mean."""
    n = len(scores)
    mean = scores.mean() if n > 1 else torch.zeros((), dtype=scores.dtype)
    std = scores.std() if n > 1 else torch.ones((), dtype=scores.dtype)
    return (scores - mean) / (std + eps) if norm_by_std else scores - mean


@ADVANTAGE_ESTIMATORS.register("rloo", kind="group")
def rloo_advantages(scores: torch.Tensor, norm_by_std: bool, eps: float) -> torch.Tensor:
    """n / (n - 1) (s - mean): the leave-one-out baseline."""
    n = len(scores)
    return (scores - scores.mean()) * n / (n - 1) if n > 1 else torch.zeros_like(scores)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline", kind="group", whitened=True)
def baseline_advantages(scores: torch.Tensor, norm_by_std: bool, eps: float) -> torch.Tensor:
    """s - mean (REINFORCE++ with a group baseline; the batch whitening follows in the caller, over every rank)."""
    mean = scores.mean() if len(scores) > 1 else torch.zeros((), dtype=scores.dtype)
    return scores - mean


def group_advantages(scores: torch.Tensor, groups: torch.Tensor, estimator: str, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantages from per-sequence scores (B,) and group ids (B,) (sequences of one prompt), by the
    group estimator `estimator` of ADVANTAGE_ESTIMATORS."""
    advantages = torch.empty_like(scores)
    for group in groups.unique():
        members = groups == group
        advantages[members] = ADVANTAGE_ESTIMATORS[estimator](scores[members], norm_by_std, eps)
    return advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus", kind="token", whitened=True)
def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s returns of one response (tokens,): sum of gamma^k r_{t+k} over its generated tokens (mask 1).
    Tokens off the mask (a tool's, an environment's) are skipped, not a reset: verl's reset there would cut a
    multi-turn trajectory's final reward off from every turn before its last tool call."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros((), dtype=token_rewards.dtype)
    for t in reversed(range(len(token_rewards))):
        running = torch.where(mask[t] > 0, token_rewards[t] + gamma * running, running)
        returns[t] = running
    return returns * mask


@ADVANTAGE_ESTIMATORS.register("gae", kind="critic", whitened=True)
def gae_advantages_returns(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                           lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over one response (tokens,), as verl's compute_gae_advantage_return
    (before its whitening): delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, returns A + V.
    Tokens off the mask (a tool's, an environment's) are skipped, not reset: they pass the next token's value and
    advantage through unchanged, so that a turn's advantage reaches across them."""
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros((), dtype=values.dtype)
    next_advantage = torch.zeros((), dtype=values.dtype)
    for t in reversed(range(len(token_rewards))):
        delta = token_rewards[t] + gamma * next_value - values[t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(mask[t] > 0, values[t], next_value)
        next_advantage = torch.where(mask[t] > 0, advantage, next_advantage)
        advantages[t] = next_advantage
    return advantages, advantages + values


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, total: float, total_squares: float, count: float, eps: float = 1e-8) -> torch.Tensor:
    """(v - mean) / sqrt(var + eps) over the masked tokens of the whole batch, from its global sums (so that every
    rank whitens with the same statistics); Bessel-corrected variance, as verl's masked_whiten."""
    mean = total / count
    variance = (total_squares - count * mean**2) / max(count - 1, 1)
    return (values - mean) * torch.rsqrt(torch.tensor(variance + eps, dtype=values.dtype)) * mask


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

    token-mean: sum over all tokens / global token count. seq-mean-token-sum: per-sequence token sums, averaged
    over global sequences. seq-mean-token-mean: per-sequence token means, averaged likewise.
    seq-mean-token-sum-norm: token sums / (loss_scale_factor or max_response_length), averaged over sequences
    (Dr. GRPO)."""
    return LOSS_AGG_MODES[mode](loss * mask, sequence_tokens, global_tokens, global_sequences, loss_scale_factor or max_response_length)


@LOSS_AGG_MODES.register("token-mean")
def token_mean(masked: torch.Tensor, sequence_tokens: torch.Tensor, tokens: float, sequences: float, norm: float) -> torch.Tensor:
    return masked.sum() / max(tokens, 1.0)


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
@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(log_probs, old_log_probs, advantages, mask, sequence_log_ratio, clip_low: float, clip_high: float, clip_c: float):
    """PPO's clipped surrogate with dual clip: per-token loss max(-A r, -A clip(r, 1-low, 1+high)), and for A < 0
    at most -A c. Returns (per-token loss, clipped mask, lower-clipped mask)."""
    ratio = torch.exp((log_probs - old_log_probs).clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = -advantages * clip_c
    lower = (loss > dual) & (advantages < 0)
    loss = torch.where(advantages < 0, torch.minimum(loss, dual), loss)
    return loss, (clipped > unclipped).float() * mask, lower.float() * mask


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(log_probs, old_log_probs, advantages, mask, sequence_log_ratio, clip_low: float, clip_high: float, clip_c: float):
    """GSPO: the sequence-level ratio s_i = exp(`sequence_log_ratio`, the mean log(pi / pi_old) over the response,
    detached, on each of its tokens) carried to each token as s_i exp(logp_t - sg[logp_t]); two-sided clip, no
    dual clip."""
    ratio = torch.exp((sequence_log_ratio + log_probs - log_probs.detach()).clamp(max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float() * mask, torch.zeros_like(mask)



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
                       threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights of one response (tokens,) for the gap between the engine that sampled it and
    the trainer's old policy: token, exp(old - rollout) per token; sequence, exp(sum over the response of
    old - rollout) on every token. Returns (the weights capped at `threshold`, 0 off the mask; the raw weights)."""
    log_ratio = (old_log_probs - rollout_log_probs) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum().expand_as(mask)
    raw = torch.exp(log_ratio.clamp(-20.0, 20.0))
    return raw.clamp(max=threshold) * mask, raw


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
