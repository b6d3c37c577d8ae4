"""The GRPO family's formulas against values worked out by hand, on small tensors with padding masks (against verl's own
code: test_verl_equivalence.py)."""

import math

import pytest
import torch

from fsdptrain.rl import core_algos
from fsdptrain.rl.core_algos import ADVANTAGE_ESTIMATORS, EstimatorBatch, PolicyLossSettings, PolicyTokens


def per_response(estimator: str, scores: torch.Tensor, groups: torch.Tensor, **settings) -> torch.Tensor:
    """A group estimator's advantage of each response, each one token long."""
    advantages, _ = ADVANTAGE_ESTIMATORS[estimator](EstimatorBatch(scores[:, None], torch.ones(len(scores), 1), groups, **settings))
    return advantages[:, 0]


def test_grpo_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1])
    std = math.sqrt(1 / 3)  # Bessel's: four scores ±0.5 around 0.5
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.5]) / torch.tensor([std + 1e-6] * 4 + [1 + 1e-6])
    torch.testing.assert_close(per_response("grpo", scores, groups), expected)
    torch.testing.assert_close(per_response("grpo", scores, groups, norm_by_std=False),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0.5]))  # Dr. GRPO: no std, a lone sample keeps its score
    torch.testing.assert_close(per_response("rloo", scores, groups), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.5]))
    torch.testing.assert_close(per_response("rloo_vectorized", scores, groups),
                               torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0]))  # verl's vectorized form: 0 for a lone sample


def test_beam_pg_by_hand():
    """Three beams whose probabilities renormalize to .5, .3, .2 (two tokens each), rewards 1, 0, .5: the set's
    mean reward .6, advantages .5 x .4, .3 x -.6, .2 x -.1 on every token; a group of two equal beams with equal
    rewards gets 0; the advantages of a group sum to 0."""
    log_probs = torch.tensor([[math.log(0.5) - 1, 1.0], [math.log(0.3) - 1, 1.0], [math.log(0.2) - 1, 1.0], [-1.0, -2.0], [-2.0, -1.0]])
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.5], [0.0, 1.0], [0.0, 1.0]])
    advantages, _ = ADVANTAGE_ESTIMATORS["beam_pg"](EstimatorBatch(rewards, torch.ones(5, 2), torch.tensor([0, 0, 0, 1, 1]), old_log_probs=log_probs))
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.2, -0.18, -0.02, 0.0, 0.0]))
    torch.testing.assert_close(advantages[:, 1], advantages[:, 0])


def test_beam_pg_is_the_gradient_of_the_sets_expected_reward(tiny_llama):
    """On a tiny model, four responses to one prompt: sum_k A_k grad log pi(y_k), with beam_pg's advantages, equals
    autograd's gradient of E_pi~[r] = softmax(log pi(y))·r."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64)
    prompt, responses = [5, 17, 42], [[7, 8, 2], [7, 9, 2], [11, 2], [12, 13, 14, 2]]
    width = max(map(len, responses))
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses], dtype=torch.float64)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(4), mask.sum(-1).long() - 1] = torch.tensor([1.0, 0.2, 0.0, 0.7], dtype=torch.float64)

    def token_log_probs() -> torch.Tensor:
        rows = []
        for response in responses:
            ids = torch.tensor([prompt + response])
            row = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1).gather(1, ids[0, len(prompt):, None])[:, 0]
            rows.append(torch.cat([row, row.new_zeros(width - len(response))]))
        return torch.stack(rows)

    expected_reward = ((token_log_probs() * mask).sum(-1).softmax(0) * rewards.sum(-1)).sum()
    expected = torch.autograd.grad(expected_reward, list(model.parameters()))
    log_probs = token_log_probs()
    advantages, _ = ADVANTAGE_ESTIMATORS["beam_pg"](EstimatorBatch(rewards, mask, torch.zeros(4), old_log_probs=log_probs.detach()))
    ours = torch.autograd.grad((advantages * log_probs * mask).sum(), list(model.parameters()))
    assert sum(float(g.abs().sum()) for g in expected) > 1e-6
    for mine, theirs in zip(ours, expected):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)


def reinforce_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s returns of one response."""
    returns, _ = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](EstimatorBatch(rewards[None], mask[None], torch.zeros(1), gamma=gamma))
    return returns[0]


def test_reinforce_plus_plus_returns_and_whitening():
    rewards, mask = torch.tensor([0.0, 0.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(reinforce_returns(rewards, mask, 0.5), torch.tensor([0.25, 0.5, 1.0, 0.0]))
    # A multi-turn trajectory: turn 1 (2 tokens), a tool's 2 tokens (mask 0), turn 2 (2 tokens, the reward on its
    # last). The return runs across the tool's tokens, undiscounted there, and is 0 on them.
    rewards, mask = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(reinforce_returns(rewards, mask, 0.5), torch.tensor([0.125, 0.25, 0.0, 0.0, 0.5, 1.0]))
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mean, variance = core_algos.batch_moments(values, torch.ones(4), lambda sums: sums)
    assert (mean, variance) == (2.5, 5 / 3)
    whitened = core_algos.masked_whiten(values, torch.ones(4), mean, variance)
    torch.testing.assert_close(whitened, (values - 2.5) / math.sqrt(5 / 3 + 1e-8))
    # every value equal: 0 (no NaN), whatever the sums' rounding
    constant = torch.full((1000,), 0.1)
    assert core_algos.masked_whiten(constant, torch.ones(1000), *core_algos.batch_moments(constant, torch.ones(1000), lambda sums: sums)).eq(0).all()


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
SEQUENCE_TOKENS = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]])  # each token's sequence's count of masked tokens


@pytest.mark.parametrize(
    "mode, expected",
    [("token-mean", 7 / 3), ("seq-mean-token-sum", 3.5), ("seq-mean-token-mean", 2.75), ("seq-mean-token-sum-norm", 7 / 6)],
)
def test_aggregation_by_hand_and_split_anywhere(mode, expected):
    agg = lambda loss, mask, tokens: core_algos.agg_loss(  # noqa: E731
        loss.flatten(), mask.flatten(), tokens.flatten(), mode, global_tokens=3, global_sequences=2, max_response_length=3)
    assert float(agg(LOSS, MASK, SEQUENCE_TOKENS)) == pytest.approx(expected)
    # Split by sequence (two ranks or micro-batches), each over the global counts: the halves sum to the whole.
    halves = sum(float(agg(LOSS[i : i + 1], MASK[i : i + 1], SEQUENCE_TOKENS[i : i + 1])) for i in range(2))
    assert halves == pytest.approx(expected)
    # Split inside the sequences (Ulysses slices of the tokens): the slices sum to the whole too.
    slices = sum(float(agg(LOSS[:, i : i + 1], MASK[:, i : i + 1], SEQUENCE_TOKENS[:, i : i + 1])) for i in range(3))
    assert slices == pytest.approx(expected)
    if mode == "seq-mean-token-sum-norm":
        scaled = core_algos.agg_loss(LOSS.flatten(), MASK.flatten(), SEQUENCE_TOKENS.flatten(), mode, 3, 2, 3, loss_scale_factor=2.0)
        assert float(scaled) == pytest.approx((3 / 2 + 4 / 2) / 2)


def flat_tokens(log_probs, old, advantages, mask, sequences=None) -> PolicyTokens:
    """PolicyTokens of flat tokens, each its own sequence unless `sequences` (each token's sequence index)."""
    sequences = torch.arange(len(mask)) if sequences is None else sequences
    count = int(sequences.max()) + 1
    lengths = core_algos.sequence_sums(mask, sequences, count)[sequences]

    def sequence_mean(values):
        return core_algos.sequence_sums(values * mask, sequences, count)[sequences] / lengths.clamp(min=1)

    return PolicyTokens(log_probs, old, advantages, mask, sequence_mean, lengths)


def test_vanilla_loss_clips_and_dual_clips_by_hand():
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    ratios = torch.tensor([1.5, 0.5, 5.0, 1.1])
    old = torch.zeros(4)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    tokens = flat_tokens(ratios.log(), old, advantages, mask)
    loss, clipped, lower = core_algos.vanilla_policy_loss(tokens, PolicyLossSettings(0.2, 0.2, 3.0))
    # A=1, r=1.5: max(-1.5, -1.2) = -1.2 (clipped); A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped);
    # A=-1, r=5: max(5, 1.2) = 5, dual clip min(5, 3) = 3 (lower-clipped); A=1, r=1.1: -1.1.
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, 3.0, -1.1]))
    assert clipped.tolist() == [1.0, 1.0, 0.0, 0.0] and lower.tolist() == [0.0, 0.0, 1.0, 0.0]
    loss, _, _ = core_algos.vanilla_policy_loss(tokens, PolicyLossSettings(0.2, 0.28, 3.0))
    assert float(loss[0]) == pytest.approx(-1.28)  # clip-higher


def test_first_ratio_is_exactly_one_and_its_gradient_is_the_advantage():
    log_probs = torch.tensor([-2.0, -1.0, -3.0], requires_grad=True)
    advantages = torch.tensor([0.5, -1.0, 2.0])
    tokens = flat_tokens(log_probs, log_probs.detach(), advantages, torch.ones(3))
    loss, clipped, _ = core_algos.vanilla_policy_loss(tokens, PolicyLossSettings())
    torch.testing.assert_close(loss, -advantages)
    loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, -advantages)
    assert clipped.sum() == 0


def test_gspo_uses_the_sequence_ratio_with_token_gradients():
    log_probs = torch.tensor([math.log(2.0), 0.0, -1.0], requires_grad=True)
    old = torch.tensor([0.0, 0.0, -1.0])
    sequences, mask = torch.tensor([0, 0, 1]), torch.ones(3)
    advantages = torch.tensor([1.0, 1.0, -1.0])
    loss, clipped, _ = core_algos.gspo_policy_loss(flat_tokens(log_probs, old, advantages, mask, sequences), PolicyLossSettings(0.5, 0.5))
    # sequence 0: exp(mean(log 2, 0)) = sqrt(2), inside 1.5: -sqrt(2) on both tokens; sequence 1: ratio 1
    torch.testing.assert_close(loss.detach(), torch.tensor([-math.sqrt(2), -math.sqrt(2), 1.0]))
    loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([-math.sqrt(2), -math.sqrt(2), 1.0]))  # d/dlogp_t of -A s_i
    assert clipped.sum() == 0


def test_rollout_correction_weights_by_hand():
    old, rollout, mask = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.5, -1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0])
    capped, raw = core_algos.rollout_is_weights(old, rollout, mask, "token", upper=1.5)
    torch.testing.assert_close(raw, torch.tensor([math.exp(0.5), math.exp(-1.0), 1.0]))  # off the mask the log-ratio is 0
    torch.testing.assert_close(capped, torch.tensor([1.5, math.exp(-1.0), 0.0]))
    capped, raw = core_algos.rollout_is_weights(old, rollout, mask, "sequence", upper=1.5)
    torch.testing.assert_close(capped, torch.tensor([math.exp(-0.5), math.exp(-0.5), 0.0]))  # exp(0.5 - 1) on every token
    for level in ("token", "sequence"):  # the same policy on both sides: weights exactly 1
        capped, _ = core_algos.rollout_is_weights(old, old.clone(), mask, level, upper=2.0)
        assert capped.tolist() == [1.0, 1.0, 0.0]
    icepop, _ = core_algos.rollout_is_weights(old, rollout, mask, "token", upper=1.5, lower=0.3)  # exp(0.5) above 1.5: 0, not capped
    torch.testing.assert_close(icepop, torch.tensor([0.0, math.exp(-1.0), 0.0]))


def test_kl_estimators_by_hand_and_straight_through_gradient():
    log_probs, ref = torch.tensor([-1.0], requires_grad=True), torch.tensor([-2.0])
    expected = {"kl": 1.0, "k1": 1.0, "abs": 1.0, "mse": 0.5, "k2": 0.5, "low_var_kl": math.exp(-1) + 1 - 1, "k3": math.exp(-1)}
    for estimator, value in expected.items():
        assert float(core_algos.kl_penalty(log_probs, ref, estimator).detach()) == pytest.approx(value), estimator
    straight = core_algos.kl_penalty(log_probs, ref, "low_var_kl+")
    assert float(straight.detach()) == pytest.approx(math.exp(-1))  # the value of k3
    straight.backward()
    assert float(log_probs.grad) == pytest.approx(1.0)  # the gradient of k2: logp - ref


def test_kl_controllers_by_hand():
    fixed = core_algos.KLController("fixed", 0.1, target=0.05, horizon=100)
    fixed.update(current_kl=1.0, n_steps=50)
    assert fixed.value == 0.1
    adaptive = core_algos.KLController("adaptive", 0.1, target=0.05, horizon=100)
    adaptive.update(current_kl=0.06, n_steps=50)  # error 0.06 / 0.05 - 1 = 0.2: x (1 + 0.2 * 50 / 100)
    assert adaptive.value == pytest.approx(0.11)
    adaptive.update(current_kl=1.0, n_steps=50)  # error clipped to 0.2
    assert adaptive.value == pytest.approx(0.121)
    restored = core_algos.KLController("adaptive", 0.1, target=0.05, horizon=100)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl's compute_gae_advantage_return over a padded (batch, tokens) batch, as its core_algos writes it:
    observation tokens (mask 0) keep the next value and advantage; then masked whitening (unbiased variance)."""
    nextvalues, lastgaelam, reversed_advantages = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        reversed_advantages.append(lastgaelam)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    returns = advantages + values
    valid = advantages[response_mask.bool()]
    whitened = (advantages - valid.mean()) * torch.rsqrt(valid.var() + 1e-8)
    return whitened * response_mask, returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_equals_verls_on_random_padded_batches_with_tool_tokens(gamma, lam):
    """Responses of different lengths (padding after the end), some with a run of tool tokens (mask 0) inside;
    the reward on the last generated token. Whitened over the batch."""
    g = torch.Generator().manual_seed(3)
    lengths, width = [7, 4, 9, 1], 9
    rewards, values, mask = torch.zeros(4, width), torch.randn(4, width, generator=g), torch.zeros(4, width)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        if length > 5:
            mask[row, 2:4] = 0  # a tool's tokens between two turns
        rewards[row, length - 1] = float(torch.rand((), generator=g))
    expected_advantages, expected_returns = verl_gae(rewards, values, mask, gamma, lam)
    advantages, returns = ADVANTAGE_ESTIMATORS["gae"](EstimatorBatch(rewards, mask, torch.arange(4), gamma=gamma, lam=lam, values=values))
    mean, variance = core_algos.batch_moments(advantages.flatten(), mask.flatten(), lambda sums: sums)
    torch.testing.assert_close(core_algos.masked_whiten(advantages, mask, mean, variance), expected_advantages * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns * mask, expected_returns * mask, rtol=1e-6, atol=1e-6)


def test_gae_by_hand():
    """Two tokens, reward 1 on the last, V = (0.5, 0.2), gamma 0.9, lambda 0.5: delta = (0 + 0.9 * 0.2 - 0.5,
    1 - 0.2) = (-0.32, 0.8); A = (-0.32 + 0.45 * 0.8, 0.8) = (0.04, 0.8); returns A + V = (0.54, 1.0)."""
    batch = EstimatorBatch(torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), torch.zeros(1), gamma=0.9, lam=0.5, values=torch.tensor([[0.5, 0.2]]))
    advantages, returns = ADVANTAGE_ESTIMATORS["gae"](batch)
    torch.testing.assert_close(advantages, torch.tensor([[0.04, 0.8]]))
    torch.testing.assert_close(returns, torch.tensor([[0.54, 1.0]]))


def verl_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
    """verl's compute_value_loss: the clipped squared error, aggregated, halved; and the clip fraction."""
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1, vf_losses2 = (vpreds - returns) ** 2, (vpredclipped - returns) ** 2
    clipped = torch.max(vf_losses1, vf_losses2)
    if loss_agg_mode == "token-mean":
        loss = (clipped * response_mask).sum() / response_mask.sum()
    else:  # seq-mean-token-mean
        loss = ((clipped * response_mask).sum(-1) / response_mask.sum(-1)).mean()
    clipfrac = ((vf_losses2 > vf_losses1).float() * response_mask).sum() / response_mask.sum()
    return 0.5 * loss, clipfrac


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_equals_verls(mode):
    g = torch.Generator().manual_seed(5)
    vpreds, returns, values = (torch.randn(3, 6, generator=g) for _ in range(3))
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    expected_loss, expected_clipfrac = verl_value_loss(vpreds, returns, values, mask, 0.2, mode)
    per_token, clipped = core_algos.value_loss(vpreds.flatten(), values.flatten(), returns.flatten(), mask.flatten(), 0.2)
    sequence_tokens = mask.sum(-1, keepdim=True).expand(3, 6).flatten()
    loss = core_algos.agg_loss(per_token, mask.flatten(), sequence_tokens, mode, global_tokens=float(mask.sum()), global_sequences=3.0,
                               max_response_length=6)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(clipped.sum() / mask.sum(), expected_clipfrac)
    assert 0 < float(expected_clipfrac) < 1  # both branches of the clip are exercised


def test_cpgd_is_its_papers_objective():
    """CPGD (Liu et al. 2025, arXiv 2505.12504): maximize sum_t min(ln r_t A_t, clip(ln r_t, ln(1 - eps), ln(1 + eps)) A_t)
    - alpha KL(pi_old || pi_theta), the drift estimated per sampled token as r - 1 - ln r; written out per token."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(12, generator=g) * 2
    log_probs = (old + torch.randn(12, generator=g) * 0.5).requires_grad_()
    advantages = torch.randn(12, generator=g)
    eps_low, eps_high, alpha = 0.2, 0.28, 0.05
    objective = []
    for t in range(12):
        log_ratio = log_probs[t] - old[t]
        clipped = torch.clamp(log_ratio, math.log(1 - eps_low), math.log(1 + eps_high))
        surrogate = torch.minimum(log_ratio * advantages[t], clipped * advantages[t])
        objective.append(surrogate - alpha * (torch.exp(log_ratio) - 1 - log_ratio))
    expected = -torch.stack(objective)
    settings = PolicyLossSettings(clip_low=eps_low, clip_high=eps_high, policy_drift_coef=alpha)
    loss, clipped_mask, _ = core_algos.cpgd_policy_loss(flat_tokens(log_probs, old, advantages, torch.ones(12)), settings)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss.sum(), log_probs, retain_graph=True)
    (expected_grad,) = torch.autograd.grad(expected.sum(), log_probs)
    torch.testing.assert_close(grad, expected_grad)
    assert 0 < clipped_mask.sum() < 12  # both sides of the clip are exercised


def test_topr_is_its_papers_objective():
    """TOPR (Le Roux et al. 2025, arXiv 2503.14286): maximize sum over trajectories with R >= 0 of R log pi(y), plus over those
    with R < 0 of sg([pi(y) / mu(y)]_0^1) R log pi(y), log pi(y) the sum of its tokens' log-probs; written out per
    sequence and summed (the loss aggregated with seq-mean-token-sum, over 3 sequences)."""
    g = torch.Generator().manual_seed(1)
    sequences = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    mask = torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 1, 0])  # the last sequence's last token is padding
    old = -torch.rand(9, generator=g) * 2
    log_probs = (old + torch.randn(9, generator=g) * 0.3).requires_grad_()
    rewards = torch.tensor([1.0, -0.5, -2.0])
    objective = 0.0
    for i, reward in enumerate(rewards):
        tokens = (sequences == i) & (mask > 0)
        log_pi = log_probs[tokens].sum()
        if reward >= 0:
            objective = objective + reward * log_pi
        else:
            weight = torch.exp(log_pi - old[tokens].sum()).clamp(0, 1).detach()
            objective = objective + weight * reward * log_pi
    expected = -objective / 3
    tokens = flat_tokens(log_probs, old, rewards[sequences], mask, sequences)
    per_token, _, lower = core_algos.topr_policy_loss(tokens, PolicyLossSettings())
    loss = core_algos.agg_loss(per_token, mask, tokens.sequence_tokens, "seq-mean-token-sum", 8, 3, 4)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, log_probs, retain_graph=True)
    (expected_grad,) = torch.autograd.grad(expected, log_probs)
    torch.testing.assert_close(grad, expected_grad)
