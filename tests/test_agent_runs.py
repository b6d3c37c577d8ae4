"""Multi-turn GRPO through the real CLI under torchrun (gloo, CPU), on the tiny calculator-calling model of
test_agent.py: the loss, entropy and advantages are those of the generated tokens alone (recomputed with a plain
transformers forward over the run's dumped trajectories), what the tools report reaches the reward function, a
resumed run draws the same trajectories, vLLM's engine gives the trajectories HF's does, and sokoban runs end to
end through the environment adapter."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from checks.verl_reference import load_core_algos
from conftest import REPO, read_metrics, torchrun

pytestmark = pytest.mark.slow

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the answer, worth half without a tool call; the tool's counts as the multi-turn loop reports them
    answered = f"#### {ground_truth}" in solution_str
    return {"score": float(answered) * (1.0 if extra_info["tool_calls"] else 0.5), "tool_calls": float(extra_info["tool_calls"]),
            "turns": float(extra_info["num_turns"])}
"""
TOOLS = """tools:
  - class_name: fsdptrain.rl.agent.tools.CalculatorTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression.
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""


@pytest.fixture(scope="module")
def agent_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("agent_data")
    for split, count in (("train", 16), ("val", 4)):
        rows = [{"prompt": [{"role": "user", "content": f"What is {i + 3} * {2 * i + 5}?"}], "data_source": "arithmetic",
                 "reward_model": {"ground_truth": "408", "style": "rule"}, "extra_info": {"index": i}} for i in range(count)]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
    (out / "reward.py").write_text(REWARD)
    (out / "tools.yaml").write_text(TOOLS)
    return out


def agent_args(model: str, data, out: str, **overrides) -> list[str]:
    args = {
        "data.train_files": str(data / "train.parquet"), "data.val_files": str(data / "val.parquet"), "data.max_prompt_length": 64,
        "data.max_response_length": 64, "data.train_batch_size": 4, "data.shuffle": "false", "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.model.enable_gradient_checkpointing": "false", "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.optim.lr": "1e-3", "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.rollout.multi_turn.enable": "true",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(data / "tools.yaml"), "custom_reward_function.path": str(data / "reward.py"),
        "trainer.total_training_steps": 2, "trainer.logger": "[file]", "trainer.default_local_dir": out, "trainer.device": "cpu",
        "trainer.rollout_data_dir": f"{out}/rollouts", "trainer.test_freq": 2,
    }
    args.update({k.replace("__", "."): v for k, v in overrides.items()})
    return [f"{k}={v}" for k, v in args.items()]


def dumped(out: str, step: int) -> list[dict]:
    with open(os.path.join(out, "rollouts", f"{step}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, tool_model, agent_data):
    out = str(tmp_path_factory.mktemp("agent_run"))
    torchrun(2, "fsdptrain.grpo_trainer", agent_args(tool_model, agent_data, out))
    return out


def test_a_multi_turn_run_reports_its_turns_tools_and_drift(agent_run):
    metrics = read_metrics(agent_run)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ("num_turns/mean", "num_turns/max", "num_turns/min", "multi_turn/tool_calls_per_trajectory", "multi_turn/tool_errors_per_trajectory",
                    "multi_turn/tool_timeouts_per_trajectory", "multi_turn/format_errors_per_trajectory", "multi_turn/drift_rate"):
            assert key in m, key
        assert m["num_turns/min"] >= 2 and m["num_turns/max"] <= 4
    assert "val-core/arithmetic/acc/mean@1" in metrics[-1]  # validation runs the same loop
    assert all(os.path.getsize(os.path.join(agent_run, "plots", name)) > 0 for name in ("turns.png", "tools.png"))
    rows = dumped(agent_run, 1)
    assert len(rows) == 16
    for row in rows:
        trained = [t for t in row["turns"] if t["trained"]]
        assert [t["role"] for t in trained] == ["assistant"] * row["trace"]["assistant_turns"]
        assert all(t["role"] == "tool" for t in row["turns"] if not t["trained"])
        assert row["tool_calls"] == row["trace"]["tool_calls"] and row["turns"] == row["turns"] and row["turns"][0]["role"] == "assistant"
        assert row["response_length"] == sum(row["response_mask"])  # generated tokens only
    assert {row["trace"]["tool_calls"] for row in rows} >= {0, 1}  # trajectories with and without a tool call
    assert metrics[0]["response_length/mean"] == pytest.approx(sum(sum(r["response_mask"]) for r in rows) / len(rows))


def test_the_loss_is_over_the_generated_tokens_alone(agent_run, tool_model):
    """Step 1's entropy and policy loss from a plain transformers forward of the initial model over the dumped
    trajectories, counting only mask-1 tokens: the logged figures. Counting the tool's tokens too gives other
    numbers (checked, so that this test can fail)."""
    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32)
    entropy_sum = all_entropy_sum = tokens = all_tokens = weighted_advantage = 0.0
    for row in dumped(agent_run, 1):
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            # fp32, as the model computes: the entropy of so peaked a distribution moves by 3e-4 of itself in fp64
            logits = model(ids).logits[0, len(row["prompt_ids"]) - 1 : -1]
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        mask = torch.tensor(row["response_mask"], dtype=torch.float32)
        entropy_sum += float((entropy * mask).sum())
        all_entropy_sum += float(entropy.sum())
        tokens += float(mask.sum())
        all_tokens += len(mask)
        weighted_advantage += row["advantage"] * float(mask.sum())  # GRPO: one advantage on each of a response's tokens
    step = read_metrics(agent_run)[0]
    assert step["actor/entropy"] == pytest.approx(entropy_sum / tokens, rel=1e-5)
    assert abs(all_entropy_sum / all_tokens - entropy_sum / tokens) > 1e-2  # the tool's tokens would show
    # One mini-batch, one epoch: the ratio is 1 and the token-mean loss is minus the mean advantage over tokens.
    assert step["actor/pg_loss"] == pytest.approx(-weighted_advantage / tokens, abs=1e-5)


def test_the_multi_turn_optimal_token_baseline_is_verls_over_the_agent_loops_masks(tmp_path, tool_model, agent_data):
    """tir_optimal_token_baseline on tool-calling trajectories: each dumped advantage (the mean over the trajectory's
    generated tokens) is that of verl's own function given the initial model's log-probs and squared-probability
    sums over the dumped trajectories (a plain transformers forward) and the agent loop's masks, with the tools'
    tokens among the response's."""
    verl = load_core_algos()
    if verl is None:
        pytest.skip("verl 0.9.1 is not unpacked under .cache/ (bash scripts/setup.sh test does it)")
    out = str(tmp_path)
    torchrun(2, "fsdptrain.grpo_trainer", agent_args(tool_model, agent_data, out, algorithm__adv_estimator="tir_optimal_token_baseline",
                                                    trainer__total_training_steps=1, trainer__test_freq=-1))
    rows = dumped(out, 1)
    assert any(0 in row["response_mask"][: max(i for i, m in enumerate(row["response_mask"]) if m)] for row in rows)  # a tool's tokens inside
    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32)
    width = max(len(row["response_ids"]) for row in rows)
    mask, rewards, log_probs, sum_pi_squared = (torch.zeros(len(rows), width) for _ in range(4))
    for i, row in enumerate(rows):
        ids, length = torch.tensor([row["prompt_ids"] + row["response_ids"]]), len(row["response_ids"])
        with torch.no_grad():
            logits = model(ids).logits[0, len(row["prompt_ids"]) - 1 : -1]
        mask[i, :length] = torch.tensor(row["response_mask"], dtype=torch.float32)
        rewards[i, int(mask[i].nonzero().max())] = row["seq_reward"]
        log_probs[i, :length] = logits.log_softmax(-1).gather(1, torch.tensor(row["response_ids"])[:, None]).squeeze(1)
        sum_pi_squared[i, :length] = logits.softmax(-1).square().sum(-1)
    groups = [i // 4 for i in range(len(rows))]  # the dump's rows by prompt, each rank's groups of n in a row
    advantages, _ = verl.get_adv_estimator_fn("tir_optimal_token_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=groups, old_log_probs=log_probs, sum_pi_squared=sum_pi_squared)
    expected = (advantages * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(torch.tensor([row["advantage"] for row in rows]), expected, atol=1e-4, rtol=1e-4)
    assert expected.abs().max() > 1e-3


def test_a_resumed_run_draws_the_same_trajectories(tmp_path, tool_model, agent_data, agent_run):
    out = str(tmp_path)
    torchrun(2, "fsdptrain.grpo_trainer", agent_args(tool_model, agent_data, out, trainer__total_training_steps=1, trainer__save_freq=1))
    torchrun(2, "fsdptrain.grpo_trainer", agent_args(tool_model, agent_data, out, trainer__save_freq=1))
    keys = ("response_ids", "response_mask", "turns", "trace", "score", "advantage")
    assert [{k: r[k] for k in keys} for r in dumped(out, 2)] == [{k: r[k] for k in keys} for r in dumped(agent_run, 2)]
    resumed, reference = read_metrics(out)[-1], read_metrics(agent_run)[-1]
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "num_turns/mean"):
        assert resumed[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key


def test_vllm_gives_the_trajectories_hf_gives(tmp_path, tool_model, agent_data):
    """Greedy rollouts (one step, no update) on both engines: the same turns, tool calls, masks and tokens."""
    pytest.importorskip("vllm")
    runs = {}
    for engine in ("hf", "vllm"):
        out = str(tmp_path / engine)
        torchrun(2, "fsdptrain.grpo_trainer", agent_args(tool_model, agent_data, out, actor_rollout_ref__rollout__name=engine,
                                                         actor_rollout_ref__rollout__do_sample="false", actor_rollout_ref__rollout__n=2,
                                                         actor_rollout_ref__rollout__gpu_memory_utilization=0.2, trainer__total_training_steps=1,
                                                         trainer__test_freq=-1))
        runs[engine] = dumped(out, 1)
    keys = ("response_ids", "response_mask", "turns")
    assert [{k: r[k] for k in keys} for r in runs["vllm"]] == [{k: r[k] for k in keys} for r in runs["hf"]]
    assert any(r["trace"]["tool_calls"] for r in runs["hf"])


def test_sokoban_runs_end_to_end_through_the_environment(tmp_path, tool_model):
    data = tmp_path / "sokoban"
    subprocess.run([sys.executable, "scripts/make_sokoban_data.py", str(data), "--train", "4", "--val", "2", "--max-steps", "3"], cwd=REPO,
                   check=True, capture_output=True)
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", agent_args(
        tool_model, data, out, data__train_files=str(data / "rl_train.parquet"), data__val_files=str(data / "rl_val.parquet"),
        data__max_prompt_length=256, data__max_response_length=160, actor_rollout_ref__rollout__multi_turn__tool_config_path="null",
        actor_rollout_ref__rollout__multi_turn__interaction_config_path=str(data / "sokoban_interaction.yaml"), custom_reward_function__path="null",
        **{"reward.sources": "[{name: env, function: turn_scores}]"}, trainer__total_training_steps=1, trainer__test_freq=-1))
    (m,) = read_metrics(out)
    assert m["multi_turn/success_rate"] == 0.0 and m["critic/rewards/env/mean"] < 0  # the tiny model's actions do not parse: penalties
    for row in dumped(out, 1):
        observations = [t["content"] for t in row["turns"] if t["role"] == "user"]
        assert observations and all(o.count("#") >= 20 for o in observations)  # the board, after each action
        assert row["score"] == pytest.approx(sum(row["trace"]["turn_scores"]))
