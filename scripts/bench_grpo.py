"""A GRPO step: fsdptrain (transformers generate or vLLM rollouts) against TRL's GRPOTrainer (its generate path or
its vLLM colocate mode), the same training through each system, one system at a time in its own process tree.

    python scripts/bench_grpo.py --model runs/quickstart/smollm2 --data runs/quickstart/data [--steps 4] [--prompts 4]
        [--responses 8] [--max-new-tokens 32] [--nproc 2] [--micro-batch N] [--systems fsdptrain-hf,fsdptrain-vllm,trl-hf,trl-vllm] [--json out.json]
        [--fsdptrain-overrides key=value ...] [--lora-rank 16] [--checkpoint-size] [--bf16]

The same in every system: the model (fp32 weights; fp32 compute, or bf16 with `--bf16`), the prompts (the RL training split of make_arithmetic_data.py,
in order), `--prompts` prompts x `--responses` responses a step sampled at temperature 1 up to `--max-new-tokens` tokens, the
reward (fsdptrain's built-in rule for the arithmetic data, or the `compute_score` of `--reward`, called by both), AdamW (lr, betas (0.9, 0.999), weight
decay 0.01, constant), gradient clipping at 1, one optimizer step per generation, no KL term, no gradient
checkpointing, no importance-sampling correction of the engine's samples, `--nproc` processes of one thread each
under torchrun, the vLLM engines at the same `--vllm-memory`.

Where the losses are the same: fsdptrain's GRPO advantages with loss_agg_mode=token-mean and one pass over the batch,
and TRL's loss_type=dapo with scale_rewards=group and num_iterations=1. In both the loss is minus the sum over the
step's response tokens of min(r A, clip(r, 0.8, 1.2) A) over the step's response token count on every rank; at the
first update r = 1, so the loss is -sum_i A_i L_i / sum_i L_i over the system's own samples (advantage A_i and length
L_i of response i). Each system samples from its own random stream, so the table checks each one's logged first-step
loss against that value from its own samples. (TRL divides by std + 1e-4, fsdptrain by std + 1e-6.)

Figures are means over steps 2..N (step 1 warms up). Memory is each system's largest process's peak RSS, and on CUDA
also torch.cuda.max_memory_allocated (the maximum over ranks). Generation
time includes scoring; TRL's vLLM weight sync happens inside its generation call and is taken out of it here.
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_common import checkpoint_mb, launch, torchrun  # noqa: E402

SYSTEMS = ("fsdptrain-hf", "fsdptrain-vllm", "trl-hf", "trl-vllm", "fsdptrain-hf-lora", "fsdptrain-vllm-lora")
LR, WEIGHT_DECAY = 2e-6, 0.01


def run_fsdptrain(system: str, args) -> dict:
    out = os.path.join(args.work, system)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [*torchrun(args.nproc), "-m", "fsdptrain.grpo_trainer",
           f"data.train_files={args.data}/rl_train.parquet", "data.val_files=null", "data.max_prompt_length=128",
           f"data.max_response_length={args.max_new_tokens}", f"data.train_batch_size={args.prompts}", "data.shuffle=false",
           f"actor_rollout_ref.model.path={args.model}", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
           f"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={'bf16' if args.bf16 else 'fp32'}",
           f"actor_rollout_ref.actor.optim.lr={LR}", f"actor_rollout_ref.actor.optim.weight_decay={WEIGHT_DECAY}",
           f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
           f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
           f"actor_rollout_ref.rollout.n={args.responses}", f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.prompts * args.responses}",
           f"actor_rollout_ref.rollout.name={system.split('-')[1]}", f"actor_rollout_ref.rollout.gpu_memory_utilization={args.vllm_memory}",
           f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.resume_mode=disable", "trainer.logger=[file]",
           f"trainer.default_local_dir={out}", f"trainer.rollout_data_dir={out}/rollouts", f"trainer.save_freq={args.steps}",  # the last step alone
           f"trainer.checkpoint.save_contents={'[model,optimizer]' if args.checkpoint_size else '[]'}",
           f"custom_reward_function.path={args.reward or 'null'}", *args.fsdptrain_overrides]
    if system.endswith("-lora"):
        cmd += [f"actor_rollout_ref.model.lora_rank={args.lora_rank}", f"actor_rollout_ref.model.lora_alpha={2 * args.lora_rank}"]
    memory = launch(cmd)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    rows = [json.loads(line) for line in open(os.path.join(out, "rollouts", "1.jsonl"))]
    responses = args.prompts * args.responses
    steps = [{"step": m["timing_s/step"], "gen": m["timing_s/gen"], "greedy": m.get("timing_s/gen_max", 0.0),
              "old_log_prob": m.get("timing_s/old_log_prob", 0.0),
              "update": m["timing_s/update_actor"], "sync": m["timing_s/update_weights"],
              "generated_tokens": m["response_length/mean"] * responses,
              "trained_tokens": (m["response_length/mean"] + m["prompt_length/mean"]) * responses} for m in metrics]
    return {"steps": steps, "reward": metrics[-1]["critic/score/mean"], "first_loss": metrics[0]["actor/pg_loss"],
            "first_loss_expected": expected_first_loss([(r["advantage"], r["response_length"]) for r in rows]),
            "probs_diff_max": max((m.get("training/rollout_probs_diff_max", float("nan")) for m in metrics), default=float("nan")),
            "cuda_peak_gb": max(m["perf/max_memory_gb"] for m in metrics) if torch.cuda.is_available() else None,
            "cuda_at_gen_gb": max(m["perf/memory_at_gen_gb"] for m in metrics) if torch.cuda.is_available() else None,
            "checkpoint_mb": checkpoint_mb(out) if args.checkpoint_size else None, **memory}


def expected_first_loss(advantages_and_lengths) -> float:
    """-sum A_i L_i / sum L_i: the token-mean clipped loss at ratio 1."""
    return -sum(a * length for a, length in advantages_and_lengths) / sum(length for _, length in advantages_and_lengths)


def run_trl(system: str, args) -> dict:
    out = os.path.join(args.work, system)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [*torchrun(args.nproc), __file__, "--worker", system, "--model", args.model, "--data", args.data, "--work", out,
           "--steps", str(args.steps), "--prompts", str(args.prompts), "--responses", str(args.responses), "--max-new-tokens", str(args.max_new_tokens),
           "--micro-batch", str(args.micro_batch), "--vllm-memory", str(args.vllm_memory), *(["--reward", args.reward] if args.reward else []), *(["--bf16"] if args.bf16 else [])]
    memory = launch(cmd, env={"WANDB_MODE": "disabled", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.nproc)]
    logs = [entry for entry in ranks[0]["log_history"] if "reward" in entry]
    steps = []
    for i, log in enumerate(logs):
        timing = {key: max(rank[key][i] for rank in ranks) for key in ("step", "gen", "sync")}
        tokens = log["num_tokens"] - (logs[i - 1]["num_tokens"] if i else 0)
        generated = log["completions/mean_length"] * args.prompts * args.responses
        steps.append({"step": timing["step"], "gen": timing["gen"] - timing["sync"], "greedy": 0.0, "old_log_prob": 0.0,
                      "update": timing["step"] - timing["gen"], "sync": timing["sync"], "generated_tokens": generated, "trained_tokens": tokens})
    first = [pair for rank in ranks for pair in rank["first_advantages_and_lengths"]]
    # Each rank's loss is its share of the sum over the global token count times the number of ranks (DDP averages).
    first_loss = sum(rank["loss"][0] for rank in ranks) / len(ranks)
    cuda_peak = max(rank["cuda_peak_gb"] for rank in ranks) if torch.cuda.is_available() else None
    return {"steps": steps, "reward": logs[-1]["reward"], "first_loss": first_loss, "first_loss_expected": expected_first_loss(first),
            "cuda_peak_gb": cuda_peak, **memory}


# long: one TRL run as its own user would write it, set-up to teardown; split, its measured loop would read less plainly
def trl_worker(args) -> None:
    """One rank of TRL's GRPOTrainer, timing its steps, generation calls and weight syncs."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fsdptrain.rl.rewards import load_reward_function, score_sample

    table = pq.read_table(f"{args.data}/rl_train.parquet").to_pylist()
    dataset = Dataset.from_list([{"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"],
                                  "data_source": row["data_source"]} for row in table])

    compute_score = load_reward_function(args.reward, None)

    def reward(completions, ground_truth, data_source, **_):
        return [score_sample(compute_score, source, c[0]["content"], truth, None, f"completion {i}")["score"]
                for i, (c, truth, source) in enumerate(zip(completions, ground_truth, data_source))]

    timings = {"step": [], "gen": [], "sync": [], "loss": []}
    first_step: list = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            tick = time.perf_counter()
            timings["sync"].append(0.0)
            batch = super()._generate_and_score_completions(inputs)
            timings["gen"].append(time.perf_counter() - tick)
            if not first_step:
                lengths = batch["completion_mask"].sum(dim=1)
                first_step.extend(zip(batch["advantages"].tolist(), lengths.tolist()))
            return batch

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            timings["loss"].append(float(loss.detach()))  # unrounded (the logged loss has 4 decimals)
            return loss

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.tick = time.perf_counter()

        def on_step_end(self, *_, **__):
            timings["step"].append(time.perf_counter() - self.tick)

    world = int(os.environ["WORLD_SIZE"])
    config = GRPOConfig(
        output_dir=args.work, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.prompts * args.responses // world // args.micro_batch,  # one generation an optimizer step
        num_generations=args.responses, max_completion_length=args.max_new_tokens, temperature=1.0, learning_rate=LR, weight_decay=WEIGHT_DECAY,
        adam_beta1=0.9, adam_beta2=0.999, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", num_iterations=1, shuffle_dataset=False, gradient_checkpointing=False,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=not torch.cuda.is_available(), ddp_backend="gloo",
        bf16=args.bf16, model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True, seed=0,
        use_vllm=args.worker == "trl-vllm", vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_memory,
        vllm_importance_sampling_correction=False,  # as fsdptrain here: its extra old-policy pass is not part of the training
    )
    trainer = Timed(model=args.model, reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[StepTimer()])
    if config.use_vllm:
        sync = trainer.vllm_generation.sync_weights

        def timed_sync():
            tick = time.perf_counter()
            sync()
            timings["sync"][-1] += time.perf_counter() - tick

        trainer.vllm_generation.sync_weights = timed_sync
    trainer.train()
    with open(os.path.join(args.work, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        cuda_peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        json.dump({**timings, "first_advantages_and_lengths": first_step, "log_history": trainer.state.log_history, "cuda_peak_gb": cuda_peak}, f)


def summary(result: dict) -> dict:
    """Means over steps 2..N."""
    later = result["steps"][1:] or result["steps"]
    mean = {key: sum(s[key] for s in later) / len(later) for key in later[0]}
    return {"step_s": mean["step"], "gen_s": mean["gen"], "greedy_s": mean["greedy"], "old_log_prob_s": mean["old_log_prob"], "update_s": mean["update"],
            "sync_s": mean["sync"], "generated_tokens_per_s": mean["generated_tokens"] / mean["gen"],
            "trained_tokens_per_s": mean["trained_tokens"] / mean["step"]}


def table(results: dict) -> str:
    base = results.get("fsdptrain-vllm") or results.get("fsdptrain-hf")
    lines = ["| system | step s | vs fsdptrain | gen s | greedy gen s (ReMax) | old log-prob s | update s | sync s (share) | gen tok/s "
             "| trained tok/s | peak GB/process | CUDA peak GB (held at gen) | reward, last step | first loss (expected) | engine prob diff max | checkpoint MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for system, r in results.items():
        if "error" in r:
            lines.append(f"| {system} | did not run: {r['error']} |" + " |" * 14)
            continue
        s = summary(r)
        ratio = s["step_s"] / summary(base)["step_s"] if base and "error" not in base else float("nan")
        diff = r.get("probs_diff_max", float("nan"))  # TRL logs its engine's agreement only with its correction on
        checkpoint = f"{r['checkpoint_mb']:.1f}" if r.get("checkpoint_mb") is not None else ""
        cuda_peak = f"{r['cuda_peak_gb']:.1f}" if r.get("cuda_peak_gb") is not None else ""
        if r.get("cuda_at_gen_gb") is not None:
            cuda_peak += f" ({r['cuda_at_gen_gb']:.1f})"
        lines.append(f"| {system} | {s['step_s']:.1f} | {ratio:.2f}x | {s['gen_s']:.1f} | {s['greedy_s']:.1f} | {s['old_log_prob_s']:.1f} "
                     f"| {s['update_s']:.1f} "
                     f"| {s['sync_s']:.2f} ({s['sync_s'] / s['step_s']:.0%}) | {s['generated_tokens_per_s']:.0f} "
                     f"| {s['trained_tokens_per_s']:.0f} | {r['max_proc_rss_gb']:.2f} | {cuda_peak} | {r['reward']:.3f} "
                     f"| {r['first_loss']:.6f} ({r['first_loss_expected']:.6f}) | {diff:.1e} | {checkpoint} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--data", required=True, help="the folder of make_arithmetic_data.py")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--responses", type=int, default=8, help="responses a prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, help="sequences a forward a process, in both systems (default: all of a process's)")
    parser.add_argument("--reward", help="a Python file whose compute_score(data_source, solution_str, ground_truth, extra_info) scores")
    parser.add_argument("--vllm-memory", type=float, default=0.15, help="gpu_memory_utilization of every vLLM engine")
    parser.add_argument("--systems", default=",".join(SYSTEMS[:4]), help=f"any of {', '.join(SYSTEMS)} (-lora: LoRA rows)")
    parser.add_argument("--lora-rank", type=int, default=16, help="lora_rank of the -lora rows (lora_alpha twice it)")
    parser.add_argument("--checkpoint-size", action="store_true",
                        help="fsdptrain rows save their model and optimizer once, after the last (timed) step, and show its size")
    parser.add_argument("--fsdptrain-overrides", nargs="*", default=[], help="extra key=value for the fsdptrain rows")
    parser.add_argument("--work", default="/tmp/bench_grpo")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute in every system (default fp32)")
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=("trl-hf", "trl-vllm"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    per_process = args.prompts * args.responses // args.nproc
    args.micro_batch = args.micro_batch or per_process
    if per_process % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide a process's {per_process} sequences")
    if args.worker:
        return trl_worker(args)
    results = {}
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            raise SystemExit(f"--systems: {system!r} is not one of {', '.join(SYSTEMS)}")
        print(f"== {system}", flush=True)
        try:
            results[system] = (run_fsdptrain if system.startswith("fsdptrain") else run_trl)(system, args)
        except SystemExit as e:  # a system that does not run here is a row of the table, not the end of the benchmark
            lines = str(e).strip().splitlines()  # torchrun's report ends in a banner: its root cause's line says more
            results[system] = {"error": next((line.strip() for line in lines if "Signal" in line or "Error" in line), lines[-1])[:200]}
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
