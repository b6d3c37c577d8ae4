"""Fixed-seed GRPO runs that cover the trainer's paths, to show that a refactor leaves every number where it was:
run them on the old commit and on the new one, then compare (every metric equal, the rollout dumps byte-equal).

    python scripts/fixed_seed_runs.py run OUT [--only NAME ...]     # each run's metrics and rollouts under OUT/NAME
    python scripts/fixed_seed_runs.py compare BEFORE AFTER          # exits 1 naming each difference

The runs (2 CPU processes, a tiny random Llama, arithmetic prompts, 3 steps each, 2 for vLLM): GRPO with KL
(loss and reward) and the overlong penalty; dynamic sampling with GSPO; Ulysses SP with RLOO; vLLM with TP=2
(skipped where vLLM is not installed); multi-turn with a calculator tool; PPO with a critic; LoRA.
"""

import argparse
import filecmp
import importlib.util
import os
import subprocess
import sys

from compare_metrics import differences, read

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the answer, or partial credit for a response's share of distinct characters (so a random model's groups vary)
    if f"#### {ground_truth}" in solution_str:
        return 1.0
    return len(set(solution_str)) / (2 * max(len(solution_str), 1))
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
RUNS = {
    "kl_overlong": {"actor_rollout_ref.actor.use_kl_loss": "true", "algorithm.use_kl_in_reward": "true",
                    "reward_model.overlong_buffer.enable": "true", "reward_model.overlong_buffer.len": "4"},
    "dynamic_gspo": {"algorithm.filter_groups.enable": "true", "algorithm.filter_groups.metric": "seq_reward",
                     "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo", "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"},
    "ulysses_rloo": {"actor_rollout_ref.actor.ulysses_sequence_parallel_size": "2", "algorithm.adv_estimator": "rloo",
                     "data.train_batch_size": "2", "actor_rollout_ref.actor.ppo_mini_batch_size": "2"},
    "vllm_tp2": {"actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size": "2",
                 "actor_rollout_ref.rollout.gpu_memory_utilization": "0.3", "trainer.total_training_steps": "2"},
    "multi_turn_tool": {"actor_rollout_ref.rollout.multi_turn.enable": "true", "data.max_response_length": "24"},
    "ppo_critic": {"algorithm.adv_estimator": "gae", "actor_rollout_ref.rollout.n": "1", "trainer.critic_warmup": "1"},
    "lora": {"actor_rollout_ref.model.lora_rank": "8", "actor_rollout_ref.actor.use_kl_loss": "true"},
}


def prepare(out: str) -> tuple[str, str]:
    """The tiny model (64-wide heads: vLLM's CPU attention needs them) and the data, made once under `out`."""
    model, data = os.path.join(out, "model"), os.path.join(out, "data")
    if not os.path.isdir(model):
        sys.path.insert(0, os.path.join(REPO, "scripts"))
        import make_tiny

        tokenizer = make_tiny.smollm2_tokenizer()
        make_tiny.tiny_model("llama", len(tokenizer), seed=0, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                             num_key_value_heads=1).save_pretrained(model)
        tokenizer.save_pretrained(model)
    if not os.path.isdir(data):
        subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_arithmetic_data.py"), data, "--train", "48", "--val", "4",
                        "--test", "4"], check=True, capture_output=True)
        with open(os.path.join(data, "reward.py"), "w") as f:
            f.write(REWARD)
        with open(os.path.join(data, "tools.yaml"), "w") as f:
            f.write(TOOLS)
    return model, data


def run(name: str, out: str, model: str, data: str) -> None:
    run_dir = os.path.join(out, name)
    args = {
        "data.train_files": f"{data}/rl_train.parquet", "data.val_files": f"{data}/rl_val.parquet", "data.max_prompt_length": "96",
        "data.max_response_length": "8", "data.train_batch_size": "4", "data.shuffle": "false", "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.model.enable_gradient_checkpointing": "false", "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
        "actor_rollout_ref.actor.optim.lr": "1e-3", "actor_rollout_ref.rollout.n": "4", "custom_reward_function.path": f"{data}/reward.py",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": f"{data}/tools.yaml",
        "trainer.total_training_steps": "3", "trainer.test_freq": "2", "trainer.logger": "[file]", "trainer.default_local_dir": run_dir,
        "trainer.rollout_data_dir": f"{run_dir}/rollouts", "trainer.device": "cpu", "trainer.resume_mode": "disable",
        **RUNS[name],
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fsdptrain.grpo_trainer",
               *(f"{k}={v}" for k, v in args.items())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"{name}: done")


def compare(before: str, after: str) -> list[str]:
    found = []
    for name in RUNS:
        a, b = os.path.join(before, name), os.path.join(after, name)
        ran = [os.path.isfile(f"{run}/metrics.jsonl") for run in (a, b)]
        if not any(ran):
            continue
        if not all(ran):
            found.append(f"{name}: ran in one of the two only")
            continue
        found += [f"{name}: {line}" for line in differences(read(f"{a}/metrics.jsonl"), read(f"{b}/metrics.jsonl"), 0.0, 0.0)]
        dumps = sorted(name for name in os.listdir(f"{a}/rollouts") if name.endswith(".jsonl"))  # beside them: a VLM's images/
        if dumps != sorted(name for name in os.listdir(f"{b}/rollouts") if name.endswith(".jsonl")):
            found.append(f"{name}: rollout dumps differ in their files")
        found += [f"{name}: rollouts/{d} differs" for d in dumps if not filecmp.cmp(f"{a}/rollouts/{d}", f"{b}/rollouts/{d}", shallow=False)]
        print(f"{name}: compared {len(read(f'{a}/metrics.jsonl'))} steps and {len(dumps)} rollout dumps")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("out")
    run_parser.add_argument("--only", nargs="+", choices=list(RUNS))
    compare_parser = sub.add_parser("compare")
    compare_parser.add_argument("before")
    compare_parser.add_argument("after")
    args = parser.parse_args()
    if args.command == "compare":
        found = compare(args.before, args.after)
        print("\n".join(found) or "every metric equal, every rollout dump byte-equal")
        sys.exit(1 if found else 0)
    model, data = prepare(args.out)
    for name in args.only or RUNS:
        if name == "vllm_tp2" and importlib.util.find_spec("vllm") is None:
            print(f"{name}: skipped (vLLM is not installed)")
            continue
        run(name, args.out, model, data)


if __name__ == "__main__":
    main()
