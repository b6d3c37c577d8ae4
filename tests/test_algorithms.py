"""Every advantage estimator and policy loss through the real CLI: two GRPO steps on two processes (gloo, CPU) for
each, their metrics logged under verl's names. Each run pairs a loss with an estimator, and the new estimators'
advantages are recomputed here from the run's rollout dump (scores, groups, response masks) with the papers'
formulas written out in numpy. (Each formula against verl's own code: test_verl_equivalence.py; the losses'
gradients whatever the layout: test_grpo.py.)"""

import json
import os

import numpy as np
import pytest

from conftest import read_metrics, torchrun
from test_grpo import grpo_args

N = 4  # responses a prompt (grpo_args)
ACTOR, CORRECTION = "actor_rollout_ref__actor", "algorithm__rollout_correction"
RUNS = {  # a loss with an estimator, and their own keys
    "sapo-opo": {f"{ACTOR}__policy_loss__loss_mode": "sapo", "algorithm__adv_estimator": "opo"},
    "gpg-gpg": {f"{ACTOR}__policy_loss__loss_mode": "gpg", "algorithm__adv_estimator": "gpg"},
    "clip_cov-grpo_passk": {f"{ACTOR}__policy_loss__loss_mode": "clip_cov", f"{ACTOR}__policy_loss__clip_cov_ratio": 0.1,
                            f"{ACTOR}__policy_loss__clip_cov_lb": -1.0, "algorithm__adv_estimator": "grpo_passk"},
    "kl_cov-rloo_vectorized": {f"{ACTOR}__policy_loss__loss_mode": "kl_cov", f"{ACTOR}__policy_loss__kl_cov_ratio": 0.1,
                               "algorithm__adv_estimator": "rloo_vectorized"},
    "geo_mean-grpo_vectorized": {f"{ACTOR}__policy_loss__loss_mode": "geo_mean", "algorithm__adv_estimator": "grpo_vectorized"},
    "dro-gdpo": {f"{ACTOR}__policy_loss__loss_mode": "dro", f"{ACTOR}__policy_loss__dro_beta": 0.1, "algorithm__adv_estimator": "gdpo"},
    "cispo-remax": {f"{ACTOR}__policy_loss__loss_mode": "cispo", "algorithm__adv_estimator": "remax"},
    "dppo_tv-reinforce_plus_plus": {f"{ACTOR}__policy_loss__loss_mode": "dppo_tv", "algorithm__adv_estimator": "reinforce_plus_plus"},
    "dppo_kl-reinforce_plus_plus_baseline": {f"{ACTOR}__policy_loss__loss_mode": "dppo_kl",
                                             "algorithm__adv_estimator": "reinforce_plus_plus_baseline",
                                             "algorithm__reward_norm": "group", "algorithm__reward_shift": "true"},
    "bypass_ppo_clip-rloo": {f"{CORRECTION}__bypass_mode": "true", "algorithm__adv_estimator": "rloo"},
    "bypass_reinforce-grpo": {f"{CORRECTION}__bypass_mode": "true", f"{CORRECTION}__loss_type": "reinforce",
                              f"{CORRECTION}__rollout_is": "sequence"},
    "cpgd-grpo": {f"{ACTOR}__policy_loss__loss_mode": "cpgd", f"{ACTOR}__sft_loss_coef": 0.5},
    "vanilla-optimal_token_baseline": {"algorithm__adv_estimator": "optimal_token_baseline", f"{CORRECTION}__rollout_is": "token"},
    "gspo-tir_optimal_token_baseline": {f"{ACTOR}__policy_loss__loss_mode": "gspo", f"{ACTOR}__loss_agg_mode": "seq-mean-token-mean",
                                        "algorithm__adv_estimator": "tir_optimal_token_baseline"},
    "topr-rloo": {f"{ACTOR}__policy_loss__loss_mode": "topr", "algorithm__adv_estimator": "rloo", "algorithm__whiten_advantages": "true"},
}
METRICS = ["actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
           "critic/advantages/mean", "critic/score/mean", "timing_s/adv", "timing_s/update_actor"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama, rl_data):
    """Each of RUNS, two steps, its rollouts dumped; GDPO's with two weighted entries of the reward function's dict."""
    outs = {}
    for name, overrides in RUNS.items():
        out = str(tmp_path_factory.mktemp(name))
        if overrides.get("algorithm__adv_estimator") == "gdpo":  # verl main's spelling: entries of the reward function's dict
            overrides = {**overrides, "algorithm__gdpo_reward_keys": "[score,length]", "algorithm__gdpo_reward_weights": "[1.0,0.5]",
                         "reward__reward_manager__name": "gdpo"}  # and its reward manager
        torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__rollout_data_dir=f"{out}/rollouts",
                                                        trainer__test_freq=-1, **overrides))
        outs[name] = out
    return outs


def dumped(out: str, step: int) -> list[dict]:
    return [json.loads(line) for line in open(f"{out}/rollouts/{step}.jsonl")]


def groups_of(rows: list[dict]) -> list[list[dict]]:
    """The dump's rows by prompt: each rank's groups of N in a row."""
    return [rows[i : i + N] for i in range(0, len(rows), N)]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_each_pair_trains_two_steps_with_its_metrics(runs, name):
    metrics = read_metrics(runs[name])
    assert [m["step"] for m in metrics] == [1, 2]
    # trainer.test_freq=-1 and save_freq=-1 (the default): never, not even at the last step, as verl's PPO trainer
    assert not [key for m in metrics for key in m if key.startswith("val")], name
    assert not [entry for entry in os.listdir(runs[name]) if entry.startswith("global_step_")], name
    for m in metrics:
        for key in METRICS:
            assert np.isfinite(m[key]), (name, key)
    assert any(m["actor/grad_norm"] > 0 for m in metrics), name


def whitened(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-response constants whitened as token values: the mean and Bessel variance over every response token."""
    tokens = np.repeat(values, lengths)
    return (values - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-8)


def expected_advantages(estimator: str, rows: list[dict]) -> np.ndarray:
    """Each response's advantage by the estimator's paper, from the dumped scores and response masks."""
    scores = np.array([r["seq_reward"] for r in rows])
    lengths = np.array([sum(r["response_mask"]) for r in rows])
    out = np.zeros(len(rows))
    for start in range(0, len(rows), N):
        s, length = scores[start : start + N], lengths[start : start + N]
        if estimator == "opo":  # OPO: the length-weighted mean is the optimal baseline
            out[start : start + N] = s - (length * s).sum() / length.sum()
        elif estimator == "gpg":  # GPG: (s - mean) scaled by the batch's responses over its nonzero ones
            out[start : start + N] = (s - s.mean()) * len(scores) / max(np.count_nonzero(scores), 1)
        elif estimator == "grpo_passk":  # pass@k: the best response's margin over the second, in group stds
            order = np.argsort(-s, kind="stable")
            out[start + order[0]] = (s[order[0]] - s[order[1]]) / (s.std(ddof=1) + 1e-6)
        elif estimator in ("rloo", "rloo_vectorized"):
            out[start : start + N] = (s - s.mean()) * N / (N - 1)
        elif estimator == "grpo_vectorized":
            out[start : start + N] = (s - s.mean()) / (s.std(ddof=1) + 1e-6)
    if estimator == "rloo":  # with whiten_advantages=true
        out = whitened(out, lengths)
    if estimator == "gdpo":  # GDPO: each source normalized in its group, weighted, then whitened over the tokens
        for source, weight in (("source/score", 1.0), ("source/length", 0.5)):
            values = np.array([r[source] for r in rows])
            for start in range(0, len(rows), N):
                v = values[start : start + N]
                out[start : start + N] += weight * (v - v.mean()) / (v.std(ddof=1) + 1e-6)
        out = whitened(out, lengths)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sapo-opo", "gpg-gpg", "clip_cov-grpo_passk", "kl_cov-rloo_vectorized", "geo_mean-grpo_vectorized",
                                  "dro-gdpo", "topr-rloo"])
def test_the_new_estimators_advantages_are_the_papers(runs, name):
    estimator = RUNS[name]["algorithm__adv_estimator"]
    for step in (1, 2):
        rows = dumped(runs[name], step)
        got = np.array([r["advantage"] for r in rows])
        np.testing.assert_allclose(got, expected_advantages(estimator, rows), atol=2e-5, err_msg=f"{name} step {step}")
        assert np.abs(got).max() > 1e-3, f"{name} step {step}: every advantage is 0, nothing was compared"
    if estimator == "grpo_passk":
        assert all(sum(r["advantage"] != 0 for r in group) <= 1 for group in groups_of(dumped(runs[name], 1)))


@pytest.mark.slow
def test_remax_subtracts_the_greedy_responses_score(tmp_path, tiny_llama, rl_data, runs):
    """With sampling, the advantages spread and the greedy rollout is timed; without (do_sample=false) every
    response is the greedy one, so each advantage is exactly 0."""
    metrics = read_metrics(runs["cispo-remax"])
    assert all(m["timing_s/gen_max"] > 0 for m in metrics)
    assert any(m["critic/advantages/max"] > m["critic/advantages/min"] for m in metrics)
    out = str(tmp_path)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, algorithm__adv_estimator="remax", trainer__total_training_steps=1,
                                                    actor_rollout_ref__rollout__do_sample="false", trainer__test_freq=-1,
                                                    trainer__rollout_data_dir=f"{out}/rollouts"))
    rows = dumped(out, 1)
    assert len({tuple(r["response_ids"]) for r in rows[:N]}) == 1  # one greedy answer a prompt
    assert all(r["advantage"] == 0 for r in rows)


@pytest.mark.slow
def test_reward_shift_only_subtracts_each_groups_mean(runs):
    """reward_norm=group with reward_shift=true (ROLL's): the rewards trained on are the scores minus their group's
    mean, so over the batch they average 0 while the scores do not."""
    for m in read_metrics(runs["dppo_kl-reinforce_plus_plus_baseline"]):
        assert abs(m["critic/rewards/mean"]) < 1e-6 < m["critic/score/mean"]


@pytest.mark.slow
def test_the_sft_term_is_the_mean_nll_of_the_correct_responses(runs):
    """sft_loss_coef: actor/sft_loss is logged, a mean NLL of tokens the policy sampled (so between 0 and the
    uniform distribution's log-vocabulary), where the step has responses scored correct."""
    metrics = read_metrics(runs["cpgd-grpo"])
    assert all(0 <= m["actor/sft_loss"] < 12 for m in metrics)
    assert any(m["actor/sft_loss"] > 0 for m in metrics)
