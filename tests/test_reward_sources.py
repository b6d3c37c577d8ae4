"""Weighted reward sources and reward shaping (rl/rewards.py, rl/reward_shaping.py): the built-in verifiers, the
weighted sum, running moments against a Welford update written here one value at a time, and a GRPO run on 2
processes whose normalized, clipped rewards and advantages are recomputed from its dumped scores with numpy, and
whose resume continues the running moments exactly."""

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdptrain.rl.reward_shaping import RunningMoments
from fsdptrain.rl.rewards import VERIFIERS, RewardError, RewardSource, strict_format_score, weighted_sources

from conftest import grpo_config_problems, read_metrics, torchrun
from test_grpo import grpo_args


def test_strict_format_wants_the_answer_last():
    assert strict_format_score("so the sum is 5.\n#### 1,234") == 1.0
    assert strict_format_score("#### -3.5  \n") == 1.0
    assert strict_format_score("#### 12 because") == 0.0
    assert strict_format_score("the answer is 12") == 0.0


def test_sources_are_weighted_and_kept_apart():
    reward = weighted_sources([RewardSource("acc", VERIFIERS["gsm8k"], 1.0), RewardSource("format", VERIFIERS["strict_format"], 0.5),
                               RewardSource("length", lambda ds, s, gt, ei=None: {"score": len(s) / 100, "acc": 1.0}, -1.0)])
    assert reward("gsm8k", "#### 7", "7") == {"score": 1.0 + 0.5 - 0.06, "acc": 1.0, "source/acc": 1.0, "source/format": 1.0,
                                              "source/length": 0.06}
    assert reward("gsm8k", "7, I think", "7")["acc"] == 0.0  # the first source's accuracy
    broken = weighted_sources([RewardSource("bad", lambda *_: float("nan"), 1.0)])
    with pytest.raises(RewardError, match="reward source 'bad'"):
        broken("gsm8k", "x", "1")


def test_the_gdpo_reward_manager_names_the_experiment_to_each_call(tmp_path, tiny_llama):
    """reward.reward_manager.name=gdpo, as verl 0.9.1's GDPO reward manager: each call's extra_info also holds
    trainer.experiment_name, and the function's dict reaches GDPO whole (its entries by gdpo_reward_keys); naive
    adds nothing; another name is refused naming the key."""
    from hydra import compose, initialize_config_module

    from fsdptrain.distributed.mesh import World
    from fsdptrain.trainer.grpo import build_reward_function
    from fsdptrain.trainer.grpo_plan import read_grpo_config, reward_plan

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': 1.0, 'named': float(extra_info.get('experiment_name') == 'gdpo_demo'), 'length': len(solution_str)}\n")
    world = World(0, 1, 1, torch.device("cpu"), True)
    for manager, named in (("gdpo", 1.0), ("naive", 0.0)):
        overrides = ["data.train_files=unused.parquet", f"actor_rollout_ref.model.path={tiny_llama}", "trainer.device=cpu",
                     "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[named,length]", f"custom_reward_function.path={reward}",
                     f"reward.reward_manager.name={manager}", "trainer.experiment_name=gdpo_demo"]
        with initialize_config_module(config_module="fsdptrain.config", version_base=None):
            config = read_grpo_config(compose(config_name="grpo_trainer", overrides=overrides), [], world)
        scores = build_reward_function(reward_plan(config))("src", "an answer", "1", {"row": 3})
        assert scores["source/named"] == named and scores["source/length"] == 9.0 and scores["score"] == 1.0
    assert "reward.reward_manager.name must be one of naive|gdpo" in grpo_config_problems("reward.reward_manager.name=batch")


def test_running_moments_equal_welford_one_value_at_a_time():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size) for size in (1, 7, 64, 3, 250, 2)]
    running = RunningMoments()
    count, mean, m2 = 0, 0.0, 0.0
    for batch in batches:
        running.merge(len(batch), float(batch.mean()), float(((batch - batch.mean()) ** 2).sum()))
        for x in batch:  # Welford's update
            count += 1
            delta = x - mean
            mean += delta / count
            m2 += delta * (x - mean)
        assert running.count == count
        assert running.mean == pytest.approx(mean, rel=1e-12)
        assert running.std == pytest.approx(math.sqrt(m2 / count), rel=1e-12)
    restored = RunningMoments()
    restored.load_state_dict(running.state_dict())
    assert restored == running


def test_shaping_and_sources_that_cannot_work_are_named():
    found = grpo_config_problems("algorithm.reward_norm=mean", "algorithm.reward_clip=0", "algorithm.advantage_clip=-1",
                            "reward.sources=[{name: a, function: gsm8k}, {name: a, function: nope}]")
    for expected in ("algorithm.reward_norm must be one of None|batch|group|running", "algorithm.reward_clip must be > 0",
                     "algorithm.advantage_clip must be > 0", "reward.sources[1].name='a': each source needs its own name"):
        assert expected in found, expected
    assert "reward.sources[0].function must be one of rules|gsm8k" in grpo_config_problems("reward.sources=[{name: a, function: nope}]")
    assert "rollout.n must be >= 2" in grpo_config_problems("algorithm.reward_norm=group", "actor_rollout_ref.rollout.n=1",
                                                       "algorithm.adv_estimator=reinforce_plus_plus")
    assert "reward_model.enable=true needs reward_model.model.path" in grpo_config_problems("reward_model.enable=true")
    assert "sequence parallelism for it is not built yet" in grpo_config_problems("reward_model.enable=true", "reward_model.model.path=rm",
                                                                             "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    assert "cannot score in the background here: dynamic sampling" in grpo_config_problems("reward_model.launch_reward_fn_async=true",
                                                                                        "algorithm.filter_groups.enable=true")
    assert "list the function among the sources" in grpo_config_problems("custom_reward_function.path=r.py", "reward.sources=[{name: a, function: gsm8k}]")


# The scores reach the shaping as float32: the moments agree with numpy's float64 ones to float32's precision.
SHAPING = dict(algorithm__reward_norm="running", algorithm__reward_norm_minus_mean="true", algorithm__reward_clip=1.0,
               algorithm__advantage_clip=0.8, trainer__total_training_steps=3, trainer__test_freq=-1, trainer__save_freq=1)
CLIP, ADVANTAGE_CLIP = 1.0, 0.8


@pytest.fixture(scope="module")
def shaped(tmp_path_factory, tiny_llama, rl_data):
    out = str(tmp_path_factory.mktemp("shaped"))
    sources = f"[{{name: acc, function: gsm8k}}, {{name: e, path: {rl_data / 'reward.py'}, function: compute_score, weight: 2.0}}]"
    args = grpo_args(tiny_llama, rl_data, out, custom_reward_function__path="null", reward__sources=sources, trainer__rollout_data_dir=f"{out}/rollouts",
                     **SHAPING)
    torchrun(2, "fsdptrain.grpo_trainer", args)
    return out, args


@pytest.mark.slow
def test_a_run_trains_on_its_scores_normalized_by_every_score_so_far_then_clipped(shaped):
    out, _ = shaped
    metrics = read_metrics(out)
    seen = []
    for step, m in enumerate(metrics, 1):
        rows = [json.loads(line) for line in open(f"{out}/rollouts/{step}.jsonl")]
        for row in rows:
            assert row["score"] == pytest.approx(row["source/acc"] + 2.0 * row["source/e"], abs=1e-12)
        assert m["critic/rewards/e/mean"] == pytest.approx(np.mean([r["source/e"] for r in rows]), abs=1e-9)
        scores = np.array([r["seq_reward"] for r in rows])
        seen.extend(scores)
        std = np.std(seen)
        rewards = (scores - np.mean(seen)) / (std if std > 1e-8 else 1.0)
        assert m["critic/reward_running_mean"] == pytest.approx(np.mean(seen), rel=1e-6)
        assert m["critic/reward_running_std"] == pytest.approx(std, rel=1e-6)
        assert m["critic/reward_clip_frac"] == pytest.approx(np.mean(np.abs(rewards) > CLIP), abs=1e-9)
        rewards = np.clip(rewards, -CLIP, CLIP)
        assert m["critic/rewards/mean"] == pytest.approx(rewards.mean(), abs=1e-6)
        # GRPO's advantage of each response (its group's rows are consecutive in the dump), then clipped per token
        groups = torch.tensor(rewards).view(-1, 4)
        advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).flatten().numpy()
        lengths = np.array([sum(r["response_mask"]) for r in rows])
        expected_frac = float((lengths * (np.abs(advantages) > ADVANTAGE_CLIP)).sum() / lengths.sum())
        assert m["critic/advantage_clip_frac"] == pytest.approx(expected_frac, abs=1e-9)
        assert m["critic/advantages/max"] <= ADVANTAGE_CLIP + 1e-6 and m["critic/advantages/min"] >= -ADVANTAGE_CLIP - 1e-6
    assert any(m["critic/reward_clip_frac"] > 0 for m in metrics) and any(m["critic/advantage_clip_frac"] > 0 for m in metrics)
    assert os.path.isfile(f"{out}/plots/reward_sources.png")


@pytest.mark.slow
def test_the_running_moments_survive_a_resume(tmp_path, shaped):
    out, args = shaped
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(f"{out}/global_step_2", f"{resumed}/global_step_2")
    Path(resumed, "latest_checkpointed_iteration.txt").write_text("2")
    moved = [a for a in args if not a.startswith(("trainer.default_local_dir=", "trainer.rollout_data_dir="))]
    torchrun(2, "fsdptrain.grpo_trainer", moved + [f"trainer.default_local_dir={resumed}", f"trainer.rollout_data_dir={resumed}/rollouts"])
    (step3,) = read_metrics(resumed)
    straight = read_metrics(out)[2]
    for key in ("critic/reward_running_mean", "critic/reward_running_std", "critic/rewards/mean", "actor/pg_loss", "actor/grad_norm"):
        assert step3[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-9), key


@pytest.mark.slow
def test_scoring_in_the_background_gives_the_same_run(tmp_path, tiny_llama, rl_data):
    """reward_model.launch_reward_fn_async: the reward function runs in a worker thread while the old and reference
    log-probs are computed; every logged number is the in-line run's."""
    runs = {}
    for background in ("false", "true"):
        out = str(tmp_path / background)
        torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, reward_model__launch_reward_fn_async=background,
                                                        actor_rollout_ref__actor__use_kl_loss="true", actor_rollout_ref__actor__ppo_mini_batch_size=2,
                                                        trainer__test_freq=-1))
        runs[background] = read_metrics(out)
    keys = [k for k in runs["false"][0] if not k.startswith(("timing_s/", "perf/"))]
    assert "timing_s/old_log_prob" in runs["true"][0] and "actor/kl_loss" in keys
    for inline, background in zip(runs["false"], runs["true"]):
        assert {k: background[k] for k in keys} == {k: inline[k] for k in keys}
