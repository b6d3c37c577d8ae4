"""Every advantage estimator and policy loss that fsdptrain shares with verl 0.9 against the function of the same
name in verl's own core_algos (the verl==0.9.1 wheel, tests/checks/verl_reference.py), on seeded padded batches with
uneven lengths, an all-masked row, in every loss aggregation mode: values and gradients to 1e-6 in fp32."""

import dataclasses

import numpy as np
import pytest
import torch

from fsdptrain.config.grpo import importance_bounds, rejection_options
from fsdptrain.rl import core_algos
from fsdptrain.rl.core_algos import ADVANTAGE_ESTIMATORS, EstimatorBatch, PolicyLossSettings, PolicyTokens

from checks.verl_reference import load_core_algos, load_verl
from conftest import torchrun

verl = load_core_algos()
pytestmark = pytest.mark.skipif(verl is None, reason="verl 0.9.1 is not unpacked under .cache/ (bash scripts/setup.sh test does it)")
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def padded_batch(seed: int, rows: int = 6, width: int = 7, empty_row: bool = True):
    """(log_probs, old_log_probs, advantages, mask) of `rows` responses of uneven lengths, right-padded; the last
    row has no response token where `empty_row`. Advantages are per sequence (constant over its tokens) with a
    zero, ratios on both sides of every clip."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    if empty_row:
        lengths[-1] = 0
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    log_probs = -torch.rand(rows, width, generator=g) * 3
    old = log_probs + torch.randn(rows, width, generator=g) * 0.4
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width).clone()
    advantages[1] = 0.0
    return log_probs, old, advantages, mask


def ours_tokens(log_probs, old, advantages, mask) -> PolicyTokens:
    """The flat PolicyTokens of a padded batch, as the actor builds them from a packed micro-batch."""
    rows, width = mask.shape
    sequence = torch.arange(rows).repeat_interleave(width)
    lengths = mask.sum(-1)

    def sequence_mean(values):
        sums = core_algos.sequence_sums(values * mask.flatten(), sequence, rows)
        return sums[sequence] / lengths[sequence].clamp(min=1)

    return PolicyTokens(log_probs.flatten(), old.flatten(), advantages.flatten(), mask.flatten(), sequence_mean,
                        lengths[sequence])


def our_loss(loss_mode, agg_mode, settings, log_probs, old, advantages, mask):
    tokens = ours_tokens(log_probs, old, advantages, mask)
    per_token, clipped, lower = core_algos.POLICY_LOSSES[loss_mode](tokens, settings)
    mode = core_algos.POLICY_LOSSES.info[loss_mode].agg_mode or agg_mode
    sequences = core_algos.loss_rows((mask.sum(-1) > 0).tolist(), loss_mode)  # GMPO: verl's torch.mean over every row
    loss = core_algos.agg_loss(per_token, tokens.mask, tokens.sequence_tokens, mode, float(mask.sum()), sequences, mask.shape[1])
    return loss, clipped.sum() / mask.sum(), lower.sum() / mask.sum()


def verl_config(settings: PolicyLossSettings, loss_mode: str):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy_loss = PolicyLossConfig(loss_mode=loss_mode, clip_cov_ratio=settings.clip_cov_ratio, clip_cov_lb=settings.clip_cov_lb,
                                   clip_cov_ub=settings.clip_cov_ub, kl_cov_ratio=settings.kl_cov_ratio, ppo_kl_coef=settings.ppo_kl_coef,
                                   dro_beta=settings.dro_beta,
                                   rollout_correction=RolloutCorrectionConfig(loss_type=settings.bypass_loss_type, rollout_is=settings.rollout_is,
                                                                              rollout_is_threshold=settings.rollout_is_threshold))
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=settings.clip_low, clip_ratio_low=settings.clip_low,
                       clip_ratio_high=settings.clip_high, clip_ratio_c=settings.clip_c, tau_pos=settings.tau_pos, tau_neg=settings.tau_neg,
                       policy_loss=policy_loss)


def verl_policy_loss(loss_mode, settings, old, log_probs, advantages, mask, agg_mode):
    """verl's loss of that name; bypass_mode through what verl's compute_policy_loss_bypass_mode dispatches to (its
    own entry builds a DataProto, which needs tensordict): the vanilla loss against the rollout's log-probs, or
    compute_policy_loss_reinforce with compute_rollout_correction_weights."""
    config = verl_config(settings, loss_mode)
    if loss_mode != "bypass_mode":
        return verl.get_policy_loss_fn(loss_mode)(old, log_probs, advantages, mask, agg_mode, config)
    if settings.bypass_loss_type == "ppo_clip":
        return verl.compute_policy_loss_vanilla(old, log_probs, advantages, mask, agg_mode, config)
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    weights = None
    if settings.rollout_is is not None:
        with torch.no_grad():
            weights, _ = compute_rollout_correction_weights(log_probs - old, mask, settings.rollout_is, settings.rollout_is_threshold)
    return verl.compute_policy_loss_reinforce(old, log_probs, advantages, mask, agg_mode, config, weights)


VERL_LOSSES = ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo", "dppo_tv", "dppo_kl", "bypass_mode"]
SETTINGS = {
    "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": -1.0, "clip_cov_ub": 1.0},  # verl's defaults would touch no token of 35
    "kl_cov": {"kl_cov_ratio": 0.2},
    "dro": {"dro_beta": 0.3},
    "dppo_tv": {"clip_low": 0.1, "clip_high": 0.1, "clip_c": 1.5},
    "dppo_kl": {"clip_low": 0.02, "clip_high": 0.02, "clip_c": 1.5},
}


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", VERL_LOSSES)
def test_every_policy_loss_equals_verls(loss_mode, agg_mode):
    settings = PolicyLossSettings(**{"clip_low": 0.2, "clip_high": 0.28, **SETTINGS.get(loss_mode, {})})
    variants = [settings]
    if loss_mode == "bypass_mode":
        variants = [dataclasses.replace(settings, bypass_loss_type="reinforce", rollout_is=level) for level in (None, "token", "sequence")]
        variants.append(settings)
    for variant in variants:
        for seed in range(3):
            log_probs, old, advantages, mask = padded_batch(seed)
            ours_input = log_probs.clone().requires_grad_()
            verl_input = log_probs.clone().requires_grad_()
            torch.manual_seed(seed)  # Clip-Cov's draw, the same on both sides
            loss, clipfrac, lower = our_loss(loss_mode, agg_mode, variant, ours_input, old, advantages, mask)
            torch.manual_seed(seed)
            verl_loss, metrics = verl_policy_loss(loss_mode, variant, old, verl_input, advantages, mask, agg_mode)
            torch.testing.assert_close(loss, verl_loss, **TOLERANCE)
            loss.backward()
            verl_loss.backward()
            torch.testing.assert_close(ours_input.grad, verl_input.grad, **TOLERANCE)
            if loss_mode not in ("kl_cov", "bypass_mode") and "actor/pg_clipfrac" in metrics:
                assert float(clipfrac) == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
                if "actor/pg_clipfrac_lower" in metrics:
                    assert float(lower) == pytest.approx(metrics["actor/pg_clipfrac_lower"], abs=1e-6)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_gmpo_with_token_is_weights_equals_verls(agg_mode):
    """GMPO under rollout correction's token-level IS weights (an empty row included): each sequence weighed by the
    geometric mean of its tokens' weights, and the loss averaged over every row, as verl's geo_mean."""
    settings = PolicyLossSettings(clip_low=0.2, clip_high=0.28)
    for seed in range(3):
        log_probs, old, advantages, mask = padded_batch(seed)
        weights = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) * 1.5 + 0.25) * mask
        ours_input, verl_input = log_probs.clone().requires_grad_(), log_probs.clone().requires_grad_()
        tokens = ours_tokens(ours_input, old, advantages, mask)
        per_token, _, _ = core_algos.POLICY_LOSSES["geo_mean"](tokens, settings)
        per_token = core_algos.is_weighted(per_token, weights.flatten(), "geo_mean", tokens)
        loss = core_algos.agg_loss(per_token, tokens.mask, tokens.sequence_tokens, "seq-mean-token-sum", float(mask.sum()),
                                   core_algos.loss_rows((mask.sum(-1) > 0).tolist(), "geo_mean"), mask.shape[1])
        verl_loss, _ = verl.get_policy_loss_fn("geo_mean")(old, verl_input, advantages, mask, agg_mode, verl_config(settings, "geo_mean"),
                                                           weights)
        torch.testing.assert_close(loss, verl_loss, **TOLERANCE)
        loss.backward()
        verl_loss.backward()
        torch.testing.assert_close(ours_input.grad, verl_input.grad, **TOLERANCE)


GROUPS = np.array([0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 4, 4])  # uneven groups, one of one sample


def scores_cases():
    g = torch.Generator().manual_seed(0)
    yield "random", torch.rand(len(GROUPS), generator=g)
    yield "binary", (torch.rand(len(GROUPS), generator=g) > 0.5).float()
    yield "all equal", torch.full((len(GROUPS),), 0.5)


def response_mask(seed: int = 1, width: int = 6) -> torch.Tensor:
    lengths = torch.randint(1, width + 1, (len(GROUPS),), generator=torch.Generator().manual_seed(seed))
    return (torch.arange(width)[None] < lengths[:, None]).float()


def outcome_token_rewards(scores, mask):
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(mask)), mask.sum(-1).long() - 1] = scores
    return rewards


def test_every_estimator_and_loss_verl_registers_is_registered_here():
    """So that the equivalence tests below cover verl's registries (each of ours verl lacks is tested against its paper in
    test_core_algos.py)."""
    assert set(verl.ADV_ESTIMATOR_REGISTRY) <= set(ADVANTAGE_ESTIMATORS)
    assert set(verl.POLICY_LOSS_REGISTRY) <= set(core_algos.POLICY_LOSSES)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg", "grpo_passk",
                                       "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("masks", ["plain", "multi-turn"])
def test_every_group_estimator_equals_verls(estimator, norm_by_std, masks):
    """Random, binary and all-equal scores over uneven groups (one of one sample); "multi-turn": a tool's tokens
    inside two responses and an empty response (its reward kept, no token to carry it)."""
    from verl.trainer.config import AlgoConfig

    groups = GROUPS if estimator != "grpo_passk" else np.array([0, 0, 0, 0, 1, 1, 1, 3, 3, 3, 3, 4, 4, 4])  # two a group at least
    ends = response_mask()[: len(groups)]
    mask = ends.clone()
    if masks == "multi-turn":
        mask[0, 1:3] = mask[9, 1:2] = mask[5] = 0
    for case, scores in scores_cases():
        scores = scores[: len(groups)]
        rewards = outcome_token_rewards(scores, ends)
        verl_advantages, _ = verl.get_adv_estimator_fn(estimator)(
            token_level_rewards=rewards, response_mask=mask, index=groups, norm_adv_by_std_in_grpo=norm_by_std,
            config=AlgoConfig(norm_adv_by_std_in_grpo=norm_by_std))
        batch_scale = len(scores) / max(int((scores != 0).sum()), 1)
        ours, _ = ADVANTAGE_ESTIMATORS[estimator](EstimatorBatch(rewards, mask, torch.as_tensor(groups), norm_by_std=norm_by_std,
                                                                 batch_scale=batch_scale))
        if ADVANTAGE_ESTIMATORS.info[estimator].whitened:
            ours = whiten(ours, mask)
        torch.testing.assert_close(ours, verl_advantages, **TOLERANCE, msg=case)


def whiten(values, mask):
    mean, variance = core_algos.batch_moments(values.flatten(), mask.flatten(), lambda sums: sums)
    return core_algos.masked_whiten(values, mask, mean, variance)


@pytest.mark.parametrize("case", ["all equal", "small spread", "seeded"])
def test_whitening_equals_verls_where_one_pass_drifts(case):
    """verl's masked_whiten (torch_functional) on batches where a one-pass variance (sums of squares less count x
    mean²) drifts or turns negative: every value equal (verl: 0; one pass gave NaN), a spread of 0.01 around 1 over
    20k tokens, and a seeded batch with masked tokens."""
    verl_functional = load_verl("verl.utils.torch_functional")
    g = torch.Generator().manual_seed(11)
    if case == "all equal":
        values, mask = torch.full((200, 100), 0.5), torch.ones(200, 100)
    elif case == "small spread":
        values, mask = 1 + 0.01 * torch.randn(200, 100, generator=g), torch.ones(200, 100)
    else:
        values, mask = torch.randn(6, 9, generator=g) * 3 + 2, (torch.rand(6, 9, generator=g) > 0.3).float()
    expected = verl_functional.masked_whiten(values, mask) * mask
    ours = whiten(values, mask)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max().clamp(min=1)))


def test_gdpo_equals_verls_decoupled_normalization():
    mask = response_mask()
    g = torch.Generator().manual_seed(3)
    sources = torch.stack([(torch.rand(len(GROUPS), generator=g) > 0.5).float(), torch.rand(len(GROUPS), generator=g)], 1)
    sources[:4, 0] = 1.0  # a group where one source is all equal
    weights = torch.tensor([1.0, 0.5])
    prompts = torch.zeros(len(GROUPS), 2, dtype=torch.long)
    attention = torch.cat([torch.ones(len(GROUPS), 2), mask], 1).long()
    for norm_by_std in (True, False):
        config = {"norm_adv_by_std_in_grpo": norm_by_std, "gdpo_reward_keys": ["format", "accuracy"], "gdpo_reward_weights": weights.tolist()}
        verl_advantages, _ = verl.get_adv_estimator_fn("gdpo")(
            token_level_rewards=outcome_token_rewards(sources @ weights, mask), response_mask=mask, index=GROUPS,
            norm_adv_by_std_in_grpo=norm_by_std, config=config, non_tensor_batch={"format": sources[:, 0].numpy(), "accuracy": sources[:, 1].numpy()},
            batch={"prompts": prompts, "attention_mask": attention})
        ours, _ = ADVANTAGE_ESTIMATORS["gdpo"](EstimatorBatch(outcome_token_rewards(sources @ weights, mask), mask, torch.as_tensor(GROUPS),
                                                              norm_by_std=norm_by_std, source_scores=sources, source_weights=weights))
        torch.testing.assert_close(whiten(ours, mask), verl_advantages, **TOLERANCE)


def test_token_estimators_equal_verls():
    from verl.trainer.config import AlgoConfig

    mask = response_mask()
    mask[2, 1:3] = 0  # a tool's tokens inside a response: skipped, not a reset
    rewards = outcome_token_rewards(torch.rand(len(GROUPS), generator=torch.Generator().manual_seed(4)), response_mask())
    verl_advantages, verl_returns = verl.get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, config=AlgoConfig(gamma=0.9))
    groups = torch.as_tensor(GROUPS)
    advantages, returns = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](EstimatorBatch(rewards, mask, groups, gamma=0.9))
    torch.testing.assert_close(returns, verl_returns, **TOLERANCE)
    torch.testing.assert_close(whiten(advantages, mask), verl_advantages * mask, **TOLERANCE)

    baselines = torch.rand(len(GROUPS), generator=torch.Generator().manual_seed(5))
    verl_advantages, verl_returns = verl.get_adv_estimator_fn("remax")(token_level_rewards=rewards, reward_baselines=baselines,
                                                                       response_mask=mask)
    advantages, returns = ADVANTAGE_ESTIMATORS["remax"](EstimatorBatch(rewards, mask, groups, greedy_scores=baselines))
    torch.testing.assert_close(advantages, verl_advantages, **TOLERANCE)
    torch.testing.assert_close(returns, verl_returns, **TOLERANCE)


def test_gae_equals_verls():
    mask = response_mask()
    g = torch.Generator().manual_seed(6)
    rewards, values = outcome_token_rewards(torch.rand(len(GROUPS), generator=g), mask), torch.randn(mask.shape, generator=g)
    verl_advantages, verl_returns = verl.compute_gae_advantage_return(rewards, values, mask, gamma=0.95, lam=0.9)
    advantages, returns = ADVANTAGE_ESTIMATORS["gae"](EstimatorBatch(rewards, mask, torch.as_tensor(GROUPS), gamma=0.95, lam=0.9, values=values * mask))
    torch.testing.assert_close(returns * mask, verl_returns * mask, **TOLERANCE)
    torch.testing.assert_close(whiten(advantages, mask), verl_advantages * mask, **TOLERANCE)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_aggregation_equals_verls(agg_mode):
    log_probs, _, advantages, mask = padded_batch(7)
    loss = log_probs * advantages
    tokens = ours_tokens(log_probs, log_probs, advantages, mask)
    ours = core_algos.agg_loss(loss.flatten(), tokens.mask, tokens.sequence_tokens, agg_mode, float(mask.sum()),
                               float((mask.sum(-1) > 0).sum()), mask.shape[1])
    torch.testing.assert_close(ours, verl.agg_loss(loss, mask, agg_mode), **TOLERANCE)


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("with_is_weights", [False, True])
def test_optimal_token_baselines_equal_verls(estimator, with_is_weights):
    """Per-token rewards (a reward on the last token, and a denser one), uneven lengths, a group of one, a unique
    longest response (the zero tail); for the multi-turn form, masks with a tool's tokens inside and a trajectory
    with no trained token."""
    g = torch.Generator().manual_seed(8)
    mask = response_mask(seed=9, width=8)
    if estimator.startswith("tir"):
        mask[0, 1:3] = 0
        mask[5, 2] = 0
        mask[9] = 0
    rewards = outcome_token_rewards(torch.rand(len(GROUPS), generator=g), response_mask(seed=9, width=8))
    rewards += torch.rand(mask.shape, generator=g) * 0.1 * mask
    old_log_probs = -torch.rand(mask.shape, generator=g) * 3
    sum_pi_squared = torch.rand(mask.shape, generator=g) * 0.5
    is_weights = (torch.rand(mask.shape, generator=g) + 0.5) * mask if with_is_weights else None
    verl_advantages, verl_returns = verl.get_adv_estimator_fn(estimator)(
        token_level_rewards=rewards, response_mask=mask, index=GROUPS, old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared,
        rollout_is_weights=is_weights)
    advantages, returns = ADVANTAGE_ESTIMATORS[estimator](EstimatorBatch(rewards, mask, torch.as_tensor(GROUPS), old_log_probs=old_log_probs,
                                                                         sum_pi_squared=sum_pi_squared, is_weights=is_weights))
    torch.testing.assert_close(advantages, verl_advantages, **TOLERANCE)
    torch.testing.assert_close(returns, verl_returns, **TOLERANCE)


def test_rollout_correction_equals_verls_over_two_ranks():
    """Rejection in every option verl's helper has, alone and chained, with both threshold forms, and importance
    weights truncated or IcePop-bounded, normalized over both ranks' batch (tests/checks/rollout_correction_check.py)."""
    assert "equals verl's on 5 cases" in torchrun(2, "tests.checks.rollout_correction_check", []).stdout


def test_bypass_mode_equals_verls_in_each_micro_batch_over_two_ranks():
    """Rollout correction in bypass mode, in the loss of a micro-batch split over two ranks: the rejection mask of every
    rollout_rs option (chained) against the current policy, the importance weights batch-normalized over both ranks,
    and the reinforce and ppo_clip losses and their gradients equal verl 0.9.1's (tests/checks/bypass_check.py; a 10%
    change to any k-estimator or to the normalization fails it)."""
    assert "bypass mode equals verl's on 7 cases" in torchrun(2, "tests.checks.bypass_check", []).stdout


@pytest.mark.parametrize("options, thresholds", [("token_k1", "1.5"), ("token_k1", "0.2_1.2"), ("seq_sum_k1,seq_max_k3", "0.5_2,0.1"),
                                                  ("token_k2,token_k2,seq_mean_k1", 3), ("seq_mean_k2,seq_sum_k3", "0.5, 0.25")])
def test_rejection_thresholds_read_as_verls(options, thresholds):
    helper = load_verl("verl.trainer.ppo.rollout_corr_helper")
    names = list(dict.fromkeys(o.strip() for o in options.split(",")))
    expected = helper._parse_rollout_rs_thresholds(names, thresholds)
    for (level, kind, low, high), name in zip(rejection_options(options, thresholds), names, strict=True):
        assert f"{level}_{kind}" == name
        bounds = expected[name]
        if kind == "k1":
            assert (low, high) == pytest.approx((np.log(bounds["lower"]), np.log(bounds["upper"])))
        else:
            assert (low, high) == (None, bounds["upper"])
    for threshold in (2.0, "1.5", "0.5_2.0"):
        assert importance_bounds(threshold) == helper._parse_rollout_is_threshold(threshold)


def multi_turn_batch(seed: int):
    """padded_batch with a multi-turn response's holes: the tool's tokens (positions 2 and 3 of the longer rows) are
    not the policy's, mask 0 inside the response."""
    log_probs, old, advantages, mask = padded_batch(seed)
    mask[mask.sum(-1) > 4, 2:4] = 0.0
    return log_probs, old, advantages, mask


@pytest.mark.parametrize("is_level", ["token", "sequence"])
@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", [mode for mode in VERL_LOSSES if mode != "bypass_mode"])
def test_every_policy_loss_with_multi_turn_masks_and_is_weights_equals_verls(loss_mode, agg_mode, is_level):
    """Each loss on multi-turn masks (holes inside responses, an empty row) under rollout correction's decoupled IS
    weights, per token or one per sequence, as the actor applies them (core_algos.is_weighted), against verl's loss
    given the same rollout_is_weights: values and gradients."""
    settings = PolicyLossSettings(**{"clip_low": 0.2, "clip_high": 0.28, **SETTINGS.get(loss_mode, {})})
    for seed in range(3):
        log_probs, old, advantages, mask = multi_turn_batch(seed)
        g = torch.Generator().manual_seed(seed + 100)
        draw = torch.rand(mask.shape, generator=g) if is_level == "token" else torch.rand(mask.shape[0], 1, generator=g).expand_as(mask)
        weights = (draw * 1.5 + 0.25) * mask
        ours_input, verl_input = log_probs.clone().requires_grad_(), log_probs.clone().requires_grad_()
        tokens = ours_tokens(ours_input, old, advantages, mask)
        torch.manual_seed(seed)
        per_token, _, _ = core_algos.POLICY_LOSSES[loss_mode](tokens, settings)
        per_token = core_algos.is_weighted(per_token, weights.flatten(), loss_mode, tokens)
        mode = core_algos.POLICY_LOSSES.info[loss_mode].agg_mode or agg_mode
        rows = core_algos.loss_rows((mask.sum(-1) > 0).tolist(), loss_mode)
        loss = core_algos.agg_loss(per_token, tokens.mask, tokens.sequence_tokens, mode, float(mask.sum()), rows, mask.shape[1])
        torch.manual_seed(seed)
        verl_loss, _ = verl.get_policy_loss_fn(loss_mode)(old, verl_input, advantages, mask, agg_mode, verl_config(settings, loss_mode), weights)
        torch.testing.assert_close(loss, verl_loss, **TOLERANCE)
        loss.backward()
        verl_loss.backward()
        torch.testing.assert_close(ours_input.grad, verl_input.grad, **TOLERANCE)
