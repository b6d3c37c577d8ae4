"""SFT throughput and memory: fsdptrain vs TRL's SFTTrainer vs transformers' Trainer, in one run.

    python scripts/bench_sft.py [--model tiny|smollm2|1b] [--steps 10] [--batch 16] [--micro 4] [--nproc 2] [--repeats 1] [--json out.json]

Every system trains the same model from the same weights on the same token ids and loss targets (fsdptrain's
chat-template tokenization, assistant tokens only), in the same order (no shuffling), with the same global
batch, AdamW (no weight decay), constant learning rate and clipping. Their losses agree by construction:
each step's loss is the sum of token cross-entropies over the global count of loss tokens (fsdptrain's
balance_dp_token=true; Trainer's num_items_in_batch). The table shows each system's step losses against
fsdptrain's, so a system that trains something else shows up.

Throughput counts steps 2..N (step 1 warms up). With `--repeats N` each system runs N times, the systems taking
turns; the table shows each system's median run (and every run's loss tokens/s) and the largest memory peaks.
Memory: the sum over a system's processes of each one's peak RSS (exact; with several processes an upper bound
on the peak of their sum), the sampled peak of their memory with shared files (the libraries every process maps)
counted once, the largest single process's peak RSS (what one rank needs: the CPU counterpart of a GPU's memory), and
on CUDA torch.cuda.max_memory_allocated (the maximum over ranks).
MFU = (6 * matmul params * tokens + 6 * layers * hidden * sum of squared sequence lengths) / time, over a matmul
peak measured in this run. fsdptrain runs `--nproc` processes of one thread each under torchrun.
TRL and Trainer run in one process using every core; their `-ddp` variants (`trl-ddp`, `trl-padding-free-ddp`,
`trainer-ddp`) run `--nproc` DDP processes under torchrun like fsdptrain, with the same global batch.
TRL's padding-free mode is measured too: with SDPA it keeps samples apart only where transformers detects
packed position_ids, so its loss column is the check that it trains the same thing.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_common import checkpoint_mb, launch, torchrun  # noqa: E402


# ---- data shared by every system ---------------------------------------------------------------------
def tokenized(model_dir: str, train: str, max_length: int):
    from transformers import AutoTokenizer

    from fsdptrain.config.base import defaults, to_typed
    from fsdptrain.config.sft import DataConfig
    from fsdptrain.data.dataset import load_sft_samples

    base = defaults("sft_trainer").data
    base.update({"train_files": [train], "max_length": max_length, "truncation": "right"})
    base.multiturn.enable = True
    config = to_typed(base, DataConfig)
    return load_sft_samples([train], AutoTokenizer.from_pretrained(model_dir), config)


def step_tokens(samples, batch: int, steps: int):
    """(total tokens, loss tokens, sum of squared lengths) of each step's global batch, in order."""
    out = []
    for step in range(steps):
        group = samples[step * batch : (step + 1) * batch]
        out.append((sum(len(s) for s in group), sum(int(s.loss_mask[1:].sum()) for s in group), sum(len(s) ** 2 for s in group)))
    return out


# ---- the Hugging Face trainers (run in a subprocess) ---------------------------------------------------
def run_hf(system: str, args) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    samples = tokenized(args.model_dir, args.train, args.max_length)[: args.batch * args.steps]
    records = {"step_end": [], "loss": []}

    class Record(TrainerCallback):
        def on_step_end(self, *_, **__):
            records["step_end"].append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                records["loss"].append(logs["loss"])

    world = int(os.environ.get("WORLD_SIZE", 1))
    common = dict(
        output_dir=args.work, per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.batch // (args.micro * world),
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], gradient_checkpointing=False,
        dataloader_drop_last=True, seed=0, disable_tqdm=True, bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
    )
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if system.startswith("trainer"):
        rows = {"input_ids": [s.input_ids.tolist() for s in samples],
                "labels": [torch.where(s.loss_mask.bool(), s.input_ids, -100).tolist() for s in samples]}

        def collate(features):
            width = max(len(f["input_ids"]) for f in features)
            pad = lambda key, value: torch.tensor([f[key] + [value] * (width - len(f[key])) for f in features])  # noqa: E731
            mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
            return {"input_ids": pad("input_ids", 0), "labels": pad("labels", -100), "attention_mask": mask}

        class Sequential(Trainer):
            def _get_train_sampler(self, *_, **__):
                return torch.utils.data.SequentialSampler(self.train_dataset)

        trainer = Sequential(model=model, args=TrainingArguments(**common), train_dataset=Dataset.from_dict(rows),
                             data_collator=collate, callbacks=[Record()])
    else:
        from transformers import AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        rows = {"input_ids": [s.input_ids.tolist() for s in samples], "assistant_masks": [s.loss_mask.tolist() for s in samples]}

        class Sequential(SFTTrainer):
            def _get_train_sampler(self, *_, **__):
                return torch.utils.data.SequentialSampler(self.train_dataset)

        padding_free = system.startswith("trl-padding-free")  # rows come truncated; TRL asks for no max_length then
        config = SFTConfig(**common, max_length=None if padding_free else args.max_length, padding_free=padding_free,
                           assistant_only_loss=False, completion_only_loss=False, dataset_num_proc=None)
        trainer = Sequential(model=model, args=config, train_dataset=Dataset.from_dict(rows),
                             processing_class=AutoTokenizer.from_pretrained(args.model_dir), callbacks=[Record()])
    trainer.train()
    if trainer.args.process_index:  # under torchrun, rank 0 reports for all (Trainer logs losses gathered over ranks)
        return
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    with open(args.result, "w") as f:
        json.dump({"losses": records["loss"], "step_times": list(map(float, _diffs(records["step_end"]))), "cuda_peak_gb": peak}, f)


def _diffs(ends):
    return [b - a for a, b in zip(ends[:-1], ends[1:])]


# ---- orchestration ---------------------------------------------------------------------------------------
def run_fsdptrain(args, steps: list, variant: list[str]) -> dict:
    """fsdptrain under torchrun at its defaults plus `variant`'s key=value settings; `steps` are step_tokens of every
    step, to turn its logged rates into step times."""
    out = os.path.join(args.work, "fsdptrain")
    shutil.rmtree(out, ignore_errors=True)  # a repeat starts afresh (the metrics file appends)
    cmd = [*torchrun(args.nproc), "-m", "fsdptrain.sft_trainer",
           f"data.train_files={args.train}", "data.multiturn.enable=true", f"data.max_length={args.max_length}", "data.truncation=right",
           f"data.train_batch_size={args.batch}", "data.balance_dp_token=true", "data.shuffle=false", f"model.partial_pretrain={args.model_dir}",
           "model.enable_gradient_checkpointing=false", f"optim.lr={args.lr}", "optim.weight_decay=0", "optim.lr_scheduler=constant",
           "optim.lr_warmup_steps_ratio=0", f"trainer.total_training_steps={args.steps}", "trainer.logger=[file]",
           f"model.fsdp_config.mixed_precision.param_dtype={'bf16' if args.bf16 else 'fp32'}",
           "optim.betas=[0.9,0.999]", *args.fsdptrain_overrides, *variant,  # HF's AdamW betas, so that the runs agree
           f"trainer.default_local_dir={out}", "trainer.resume_mode=disable", "trainer.save_freq=-1",  # -1: at the last step alone
           f"trainer.checkpoint.save_contents={'[model,optimizer]' if args.checkpoint_size else '[]'}"]
    memory = launch(cmd)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    # perf/tokens_per_sec is (tokens of the step) / (the step's time): recover each step's time.
    times = [s[0] / m["perf/tokens_per_sec"] for s, m in zip(steps, metrics)][1:]
    return {"losses": [m["train/loss"] for m in metrics], "step_times": times, **memory,
            "cuda_peak_gb": metrics[-1]["perf/max_memory_gb"] if torch.cuda.is_available() else None,
            "checkpoint_mb": checkpoint_mb(out) if args.checkpoint_size else None}


def run_hf_system(system: str, args) -> dict:
    """TRL or Trainer in its own process (under torchrun for the -ddp variants); returns its losses, step times, memory."""
    out = os.path.join(args.work, f"{system}.json")
    launcher = torchrun(args.nproc) if system.endswith("-ddp") else [sys.executable]
    cmd = [*launcher, __file__, "--worker", system, "--model-dir", args.model_dir, "--train", args.train, "--result", out,
           "--work", os.path.join(args.work, system), "--steps", str(args.steps), "--batch", str(args.batch),
           "--micro", str(args.micro), "--max-length", str(args.max_length), "--lr", str(args.lr)] + (["--bf16"] if args.bf16 else [])
    memory = launch(cmd, env={"WANDB_MODE": "disabled"})
    with open(out) as f:
        return {**json.load(f), **memory}


# Memory columns in table order; the CUDA one is shown only where there is a GPU.
MEMORY_KEYS = ("cuda_peak_gb", "rss_gb", "shared_once_gb", "max_proc_rss_gb")


def median_run(runs: list) -> dict:
    """The run of median total step time, with every run's time and the largest memory peaks of all runs."""
    ordered = sorted(runs, key=lambda r: sum(r["step_times"]))
    median = dict(ordered[len(ordered) // 2])  # of an even count, the slower middle run
    for key in MEMORY_KEYS:
        peaks = [r[key] for r in runs if r.get(key) is not None]
        median[key] = max(peaks) if peaks else None
    median["run_seconds"] = [sum(r["step_times"]) for r in runs]
    return median


def matmul_peak_flops(threads: int) -> float:
    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = 8192 if device == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


# Random-weight Llamas with SmolLM2's tokenizer: a tiny one, and one of Llama-3.2-1B's shape (1.07B parameters with
# this 49k vocabulary) for GPU MFU.
RANDOM_MODELS = {
    "tiny": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
}


def prepare(args) -> None:
    import demo_data
    import make_tiny

    os.makedirs(args.work, exist_ok=True)
    args.train = os.path.join(args.work, "train.parquet")
    demo_data.write_chat_parquet(args.train, args.batch * args.steps, seed=0)
    if args.model in RANDOM_MODELS:
        args.model_dir = os.path.join(args.work, args.model)
        if os.path.isfile(os.path.join(args.model_dir, "config.json")):  # made by an earlier run into this --work
            return
        tokenizer = make_tiny.smollm2_tokenizer()
        make_tiny.tiny_model("llama", len(tokenizer), seed=0, **RANDOM_MODELS[args.model]).save_pretrained(args.model_dir)
        tokenizer.save_pretrained(args.model_dir)
    else:
        args.model_dir = args.smollm2_dir or os.path.join(args.work, "smollm2")
        if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
            subprocess.run([sys.executable, os.path.join(HERE, "smollm2_to_hf.py"), args.model_dir], check=True, stdout=subprocess.DEVNULL)


def parse_args() -> tuple[argparse.Namespace, dict[str, list[str]]]:
    """The arguments, with --variant rows expanded into args.systems; returns them and the variants by row name."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*RANDOM_MODELS, "smollm2"], default="tiny")
    parser.add_argument("--smollm2-dir", help="an existing SmolLM2 HF folder (default: converted into the work dir)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4, help="samples per micro-batch (per process) of the Hugging Face trainers "
                        "(fsdptrain runs at its defaults; set its keys with --variant)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per system, in turns; the table shows the median run and the largest memory peaks")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute in every system (default fp32, where losses agree tightly)")
    hf_systems = ["trl", "trl-padding-free", "trainer"]
    parser.add_argument("--systems", nargs="+", default=["fsdptrain", *hf_systems],
                        choices=["fsdptrain", *hf_systems, *(f"{s}-ddp" for s in hf_systems)])
    parser.add_argument("--work", help="work folder (default: a temporary one)")
    parser.add_argument("--fsdptrain-overrides", nargs="*", default=[], help="extra key=value for every fsdptrain row")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="KEY=VALUE",
                        help="another fsdptrain row, named by these settings (repeat for more); the first row is its defaults")
    parser.add_argument("--checkpoint-size", action="store_true",
                        help="fsdptrain rows save their model and optimizer once, after the last (timed) step, and show its size")
    parser.add_argument("--json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return args, {}
    if args.variant and "fsdptrain" not in args.systems:
        parser.error("--variant adds fsdptrain rows: keep fsdptrain among --systems")
    variants = {"fsdptrain " + " ".join(v): v for v in args.variant}
    args.systems = [name for system in args.systems for name in ([system, *variants] if system == "fsdptrain" else [system])]
    for system in args.systems:
        per_step = args.micro * (args.nproc if system.endswith("-ddp") else 1)
        if system not in ("fsdptrain", *variants) and args.batch % per_step:
            parser.error(f"--batch {args.batch} is not a multiple of {system}'s samples per accumulation step ({per_step})")
    return args, variants


def main() -> None:
    args, variants = parse_args()
    if args.worker:
        return run_hf(args.worker, args)
    with tempfile.TemporaryDirectory() as tmp:
        args.work = args.work or tmp
        prepare(args)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.model_dir)
        every_step = step_tokens(tokenized(args.model_dir, args.train, args.max_length), args.batch, args.steps)
        steps = every_step[1:]  # the timed ones
        with torch.device("meta"):
            n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        matmul_params = n_params - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
        flops = sum(6 * matmul_params * t + 6 * config.num_hidden_layers * config.hidden_size * sq for t, _, sq in steps)
        # Repeats go round the systems in turn, so that a slow spell of the machine hits all of them alike.
        # The matmul peak is measured again before each round and the best kept: a slow spell only lowers it.
        runs, peak = {system: [] for system in args.systems}, 0.0
        for _ in range(args.repeats):
            peak = max(peak, matmul_peak_flops(os.cpu_count() if not torch.cuda.is_available() else 1))
            for system in args.systems:
                if system == "fsdptrain" or system in variants:
                    runs[system].append(run_fsdptrain(args, every_step, variants.get(system, [])))
                else:
                    runs[system].append(run_hf_system(system, args))
        results = {system: median_run(system_runs) for system, system_runs in runs.items()}
    report(args, results, steps, n_params, flops, peak)


def report(args: argparse.Namespace, results: dict[str, dict], steps: list, n_params: int, flops: float, peak: float) -> None:
    """The table of every system's median run against fsdptrain's, and with --json the same rows in a file."""
    total_tokens, loss_tokens = sum(s[0] for s in steps), sum(s[1] for s in steps)
    base = results.get("fsdptrain")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    print(f"\nSFT, {args.model} ({n_params / 1e6:.1f}M params), {args.steps} steps of {args.batch} chats, device {device}, "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s")
    memory_keys = [key for key in MEMORY_KEYS if key != "cuda_peak_gb" or torch.cuda.is_available()]
    width = max(22, *map(len, results))
    print(f"{'system':<{width}} {'loss tok/s':>10} {'x':>5} {'tok/s':>8} "
          + "".join(f"{key[:-3].replace('_', ' ') + ' GB':>16} {'x':>5} " for key in memory_keys)
          + f"{'MFU':>6} {'step-1 loss':>11} {'step-N loss':>11} {'max |dloss|':>11} {'loss tok/s of each run':>24}"
          + (f" {'ckpt MB':>9}" if args.checkpoint_size else ""))
    rows = []
    for system, r in results.items():
        seconds = sum(r["step_times"])
        every_run = [loss_tokens / s for s in r["run_seconds"]]
        row = {"system": system, "loss_tokens_per_s": loss_tokens / seconds, "loss_tokens_per_s_every_run": every_run,
               "tokens_per_s": total_tokens / seconds,
               **{key: r[key] for key in memory_keys}, "mfu": flops / seconds / peak, "losses": r["losses"],
               "step_seconds": r["step_times"], "checkpoint_mb": r.get("checkpoint_mb"),
               "max_loss_diff_vs_fsdptrain": max(abs(a - b) for a, b in zip(r["losses"], base["losses"])) if base else None}
        rows.append(row)
        nan = float("nan")  # ratios and loss differences need fsdptrain among the systems
        diff = row["max_loss_diff_vs_fsdptrain"] if base else nan
        speed = row["loss_tokens_per_s"] * sum(base["step_times"]) / loss_tokens if base else nan
        print(f"{system:<{width}} {row['loss_tokens_per_s']:>10.0f} {speed:>5.2f} {row['tokens_per_s']:>8.0f} "
              + "".join(f"{r[key]:>16.2f} {r[key] / base[key] if base else nan:>5.2f} " for key in memory_keys)
              + f"{row['mfu']:>6.1%} {r['losses'][0]:>11.4f} {r['losses'][-1]:>11.4f} {diff:>11.4f} "
              + f"{' '.join(f'{x:.0f}' for x in every_run):>24}"
              + (f" {row['checkpoint_mb'] or nan:>9.1f}" if args.checkpoint_size else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "steps": args.steps, "batch": args.batch, "repeats": args.repeats, "device": device,
                       "matmul_peak_flops": peak, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
