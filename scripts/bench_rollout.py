"""Time of one rollout batch: fsdptrain's HF engine against transformers' own `generate`, on the same model,
prompts, sampling settings and thread count, in one process.

    python scripts/bench_rollout.py MODEL PROMPTS.parquet [--prompts 12] [--n 8] [--max-new-tokens 24]
        [--dtype bf16] [--repeats 3] [--json out.json]

transformers' side is what a plain loop would call: `generate(..., do_sample=True, num_return_sequences=n)` on
the left-padded prompts, with the model's default attention (SDPA). Each repeat draws other prompts; both
systems answer the same ones, with the same seed (their draws differ: the answers are alike in distribution,
not token for token, so their mean lengths are printed beside the times). The first call of each is a warm-up.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fsdptrain.rl.data import load_prompts  # noqa: E402
from fsdptrain.rl.rollout.hf import HFRollout  # noqa: E402


def transformers_generate(model, prompts: list[list[int]], n: int, max_new_tokens: int, pad_id: int, end_ids: list[int]) -> list[int]:
    """Response lengths (through the first end token) of transformers' sampling, n a prompt, one batch."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            num_return_sequences=n, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=end_ids)
    lengths = []
    for row in output[:, width:].tolist():
        lengths.append(next((i + 1 for i, t in enumerate(row) if t in end_ids), len(row)))
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("data", help="a GRPO prompts parquet (prompt column of chat messages)")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = [p.ids for p in load_prompts([args.data], tokenizer)]
    if len(prompts) < args.prompts * (args.repeats + 1):
        sys.exit(f"{args.data}: {len(prompts)} prompts, fewer than --prompts x (--repeats + 1) = {args.prompts * (args.repeats + 1)}")
    engine = HFRollout(args.model, torch.device("cpu"), dtype, pad_id)
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    systems = {
        "fsdptrain HF engine": lambda batch: [len(g.response_ids) for g in engine.generate(
            batch, n=args.n, max_new_tokens=args.max_new_tokens, batch_size=args.prompts * args.n)],
        "transformers generate": lambda batch: transformers_generate(reference, batch, args.n, args.max_new_tokens, pad_id, engine.end_ids),
    }
    results = {name: {"seconds": [], "mean_length": []} for name in systems}
    for repeat in range(args.repeats + 1):
        batch = prompts[repeat * args.prompts : (repeat + 1) * args.prompts]
        for name, run in systems.items():
            torch.manual_seed(repeat)
            start = time.perf_counter()
            with torch.no_grad():
                lengths = run(batch)
            if repeat:  # the first call warms up
                results[name]["seconds"].append(time.perf_counter() - start)
                results[name]["mean_length"].append(sum(lengths) / len(lengths))
    print(f"{args.prompts} prompts x {args.n} responses, <= {args.max_new_tokens} tokens, {args.dtype}, {torch.get_num_threads()} thread(s); "
          f"medians of {args.repeats}")
    print("| system | seconds a batch | responses / s | mean response tokens | time vs transformers |")
    print("|---|---|---|---|---|")
    base = statistics.median(results["transformers generate"]["seconds"])
    for name, r in results.items():
        seconds = statistics.median(r["seconds"])
        r.update(median_seconds=seconds, ratio=seconds / base)
        print(f"| {name} | {seconds:.2f} | {args.prompts * args.n / seconds:.1f} | {statistics.mean(r['mean_length']):.1f} | {seconds / base:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch_threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
