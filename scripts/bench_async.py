"""Asynchronous RL against the sync mode (docs/async.md): the same GRPO run on the same processes, every rank
generating then training (sync), against half of them training while the other half generate ahead
(trainer.v1.trainer_mode=separate_async), and against every rank generating and training with the unfinished
responses kept in flight across steps (colocate_async), on prompts whose answers have long-tailed lengths.

    python scripts/bench_async.py --model runs/quickstart/smollm2 [--steps 6] [--prompts 8] [--responses 4]
        [--max-new-tokens 192] [--long-every 10] [--nproc 2] [--lead 1] [--lag 8] [--bf16] [--json out.json]

The prompts: make_arithmetic_data.py's addition problems, answered in a few tokens, with every `--long-every`-th one
asking instead for a count that runs to the response limit (`--max-new-tokens`), so that one prompt in ten holds its
step's generation for many times the others' length; the measured lengths (median, 90th percentile, longest) are
in the table. Both modes: the same data in order, `--prompts` prompts x `--responses` responses a step, one update
a step (parameter_sync_step 1), fp32 (or bf16), `--nproc` processes of one thread each. separate_async trains on half
of them and generates on the other half, `--lead` batches asked for ahead; colocate_async keeps `--lead` batches in
flight ahead of the step's; in both each trained group is at most `--lag` versions behind the policy. Figures are
means over steps 2..N (step 1 starts up): the step's time and samples (prompts x responses) a second, the time
spent generating (sync, colocate_async) or waiting for generations (separate_async's training ranks), the time
the rollout ranks wait for requests or weights, and the groups left in flight after a step and those dropped for
lagging more than `--lag` over the run (colocate_async).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_common import launch, torchrun  # noqa: E402

LONG = "Count from 1 to 1000, one number a line, and write nothing else."


def long_tailed_data(out: str, long_every: int) -> str:
    """make_arithmetic_data.py's RL training split with every `long_every`-th prompt asking for a long count."""
    os.makedirs(out, exist_ok=True)
    subprocess.run([sys.executable, os.path.join(HERE, "make_arithmetic_data.py"), out, "--train", "400", "--val", "4", "--test", "4", "--system", ""],
                   check=True, capture_output=True)
    table = pq.read_table(os.path.join(out, "rl_train.parquet"))
    rows = table.to_pylist()
    for row in rows[::long_every]:
        row["prompt"] = [{**message, "content": LONG} if message["role"] == "user" else message for message in row["prompt"]]
    path = os.path.join(out, "long_tailed.parquet")
    pq.write_table(table.from_pylist(rows, schema=table.schema), path)
    return path


def run(mode: str, data: str, args) -> dict:
    out = os.path.join(args.work, mode)
    shutil.rmtree(out, ignore_errors=True)
    overrides = []
    if mode == "separate_async":
        overrides = ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=1", f"actor_rollout_ref.rollout.n_gpus_per_node={args.nproc // 2}",
                     "trainer.v1.separate_async.parameter_sync_step=1", f"trainer.v1.separate_async.num_warmup_batches={args.lead}",
                     f"trainer.v1.sampler.max_off_policy_threshold={args.lag}"]
    elif mode == "colocate_async":
        overrides = ["trainer.v1.trainer_mode=colocate_async", f"trainer.v1.colocate_async.num_warmup_batches={args.lead}",
                     f"trainer.v1.sampler.max_off_policy_threshold={args.lag}"]
    memory = launch([*torchrun(args.nproc), "-m", "fsdptrain.grpo_trainer", f"data.train_files={data}", "data.val_files=null",
                     "data.max_prompt_length=128", f"data.max_response_length={args.max_new_tokens}", f"data.train_batch_size={args.prompts}",
                     "data.shuffle=false", f"actor_rollout_ref.model.path={args.model}", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                     f"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={'bf16' if args.bf16 else 'fp32'}",
                     "actor_rollout_ref.actor.optim.lr=1e-6", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
                     f"actor_rollout_ref.rollout.n={args.responses}", f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.prompts * args.responses}",
                     f"trainer.total_training_steps={args.steps}", "trainer.logger=[file]", "trainer.resume_mode=disable",
                     f"trainer.default_local_dir={out}", f"trainer.rollout_data_dir={out}/rollouts", *overrides], env={"OMP_NUM_THREADS": "1"})
    logged = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    metrics = logged[1:] or logged
    lengths = [len(json.loads(line)["response_ids"]) for name in os.listdir(os.path.join(out, "rollouts")) if name.endswith(".jsonl")
               for line in open(os.path.join(out, "rollouts", name))]
    mean = lambda key: statistics.fmean(m.get(key, 0.0) for m in metrics)  # noqa: E731
    return {"step_s": mean("timing_s/step"), "samples_per_s": args.prompts * args.responses / mean("timing_s/step"),
            "gen_s": mean("timing_s/gen"), "update_s": mean("timing_s/update_actor"), "trainer_wait_s": mean("async/trainer_wait_s"),
            "rollout_idle_s": mean("async/rollout_idle_s"), "lag_max": max(m.get("async/staleness/max", 0.0) for m in metrics),
            "partial_responses": mean("async/partial_responses"), "in_flight_groups": mean("async/in_flight_groups"),
            "dropped_groups": sum(m.get("async/dropped_groups", 0.0) for m in logged),
            "lengths": {"p50": statistics.median(lengths), "p90": sorted(lengths)[int(0.9 * (len(lengths) - 1))], "max": max(lengths)},
            "max_proc_rss_gb": memory["max_proc_rss_gb"]}


def table(results: dict, nproc: int) -> str:
    sync = results["sync"]["samples_per_s"]
    lines = ["| mode | processes | step s | samples/s | vs sync | generation s (sync) / waiting for it (async) | update s "
             "| rollout ranks idle s | groups in flight / dropped | lag max | responses drawn by 2+ versions | length p50 / p90 / max | peak GB/process |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        processes = f"{nproc // 2} train + {nproc // 2} generate" if mode == "separate_async" else f"{nproc} train and generate"
        lengths = r["lengths"]
        lines.append(f"| {mode} | {processes} | {r['step_s']:.2f} | {r['samples_per_s']:.2f} | {r['samples_per_s'] / sync:.2f}x | {r['gen_s']:.2f} "
                     f"| {r['update_s']:.2f} | {r['rollout_idle_s']:.2f} | {r['in_flight_groups']:.1f} / {r['dropped_groups']:.0f} | {r['lag_max']:.0f} | {r['partial_responses']:.0%} "
                     f"| {lengths['p50']:.0f} / {lengths['p90']:.0f} / {lengths['max']} | {r['max_proc_rss_gb']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--responses", type=int, default=4, help="responses a prompt")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--long-every", type=int, default=10, help="every this many-th prompt asks for a long answer")
    parser.add_argument("--nproc", type=int, default=2, help="processes: separate_async trains on half, generates on the other half")
    parser.add_argument("--lead", type=int, default=1, help="batches asked for ahead (separate_async) or in flight ahead (colocate_async): num_warmup_batches")
    parser.add_argument("--lag", type=int, default=8, help="max_off_policy_threshold (verl's 8: a long response in flight goes on over several steps)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--work", default="/tmp/bench_async")
    parser.add_argument("--json")
    args = parser.parse_args()
    data = long_tailed_data(os.path.join(args.work, "data"), args.long_every)
    results = {}
    for mode in ("sync", "separate_async", "colocate_async"):
        print(f"== {mode}", flush=True)
        results[mode] = run(mode, data, args)
    print(table(results, args.nproc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
