"""Time of one rollout batch: fsdptrain's HF engine against transformers' own `generate`, on the same model,
prompts, sampling settings and thread count, in one process.

    python scripts/bench_rollout.py MODEL PROMPTS.parquet [--prompts 12] [--n 8] [--max-new-tokens 24]
        [--dtype bf16] [--repeats 3] [--beams [--catalog ITEMS]] [--json out.json]

transformers' side is what a plain loop would call: `generate(..., do_sample=True, num_return_sequences=n)` on
the left-padded prompts, with the model's default attention (SDPA). Each repeat draws other prompts; both
systems answer the same ones, with the same seed (their draws differ: the answers are alike in distribution,
not token for token, so their mean lengths are printed beside the times). The first call of each is a warm-up.
`--beams`: each prompt's n beams instead (the engine's beam search against `generate(num_beams=n,
length_penalty=0.0, early_stopping=True)`, with `--catalog` both constrained to its items), and whether the two
found the same beams.
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


def transformers_generate(model, prompts: list[list[int]], n: int, max_new_tokens: int, pad_id: int, end_ids: list[int],
                          tree: dict[tuple[int, ...], list[int]] | None, beams: bool) -> list[list[int]]:
    """The responses (through the first end token) of transformers' sampling, or beam search, n a prompt, one batch;
    with a catalog's prefix `tree`, constrained to its items."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    search = dict(num_beams=n, do_sample=False, length_penalty=0.0, early_stopping=True) if beams else dict(do_sample=True, temperature=1.0,
                                                                                                            top_k=0, top_p=1.0)
    constraint = (lambda batch_id, ids: tree.get(tuple(ids[width:].tolist()), end_ids)) if tree is not None else None
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, num_return_sequences=n, max_new_tokens=max_new_tokens,
                            pad_token_id=pad_id, eos_token_id=end_ids, prefix_allowed_tokens_fn=constraint, **search)
    responses = []
    for row in output[:, width:].tolist():
        responses.append(row[: next((i + 1 for i, t in enumerate(row) if t in end_ids), len(row))])
    return responses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("data", help="a GRPO prompts parquet (prompt column of chat messages)")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--beams", action="store_true", help="beam search: each prompt's n beams")
    parser.add_argument("--catalog", help="with --beams: constrain both to this file's items (a MiniOneRec index, or one a line)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.catalog and not args.beams:
        parser.error("--catalog goes with --beams")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = [p.ids for p in load_prompts([args.data], tokenizer)]
    if len(prompts) < args.prompts * (args.repeats + 1):
        sys.exit(f"{args.data}: {len(prompts)} prompts, fewer than --prompts x (--repeats + 1) = {args.prompts * (args.repeats + 1)}")
    engine = HFRollout(args.model, torch.device("cpu"), dtype, pad_id, beams=args.beams, catalog_file=args.catalog)
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    systems = {
        "fsdptrain HF engine": lambda batch: [g.response_ids for g in engine.generate(
            batch, n=args.n, max_new_tokens=args.max_new_tokens, batch_size=args.prompts * args.n)],
        "transformers generate": lambda batch: transformers_generate(reference, batch, args.n, args.max_new_tokens, pad_id, engine.end_ids,
                                                                     engine.catalog, args.beams),
    }
    results = {name: {"seconds": [], "mean_length": []} for name in systems}
    same = []  # with --beams, whether the two found the same beams for each repeat's batch
    for repeat in range(args.repeats + 1):
        batch = prompts[repeat * args.prompts : (repeat + 1) * args.prompts]
        answers = []
        for name, run in systems.items():
            torch.manual_seed(repeat)
            start = time.perf_counter()
            with torch.no_grad():
                answers.append(run(batch))
            if repeat:  # the first call warms up
                results[name]["seconds"].append(time.perf_counter() - start)
                results[name]["mean_length"].append(sum(map(len, answers[-1])) / len(answers[-1]))
        same.append(answers[0] == answers[1])
    kind = "beams" if args.beams else "responses"
    print(f"{args.prompts} prompts x {args.n} {kind}, <= {args.max_new_tokens} tokens, {args.dtype}, {torch.get_num_threads()} thread(s); "
          f"medians of {args.repeats}" + (f"; the same beams in {sum(same)} of {len(same)} batches" if args.beams else ""))
    print("| system | seconds a batch | responses / s | mean response tokens | time vs transformers |")
    print("|---|---|---|---|---|")
    base = statistics.median(results["transformers generate"]["seconds"])
    for name, r in results.items():
        seconds = statistics.median(r["seconds"])
        r.update(median_seconds=seconds, ratio=seconds / base)
        print(f"| {name} | {seconds:.2f} | {args.prompts * args.n / seconds:.1f} | {statistics.mean(r['mean_length']):.1f} | {seconds / base:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch_threads": torch.get_num_threads(), "results": results,
                       **({"same_beams": same} if args.beams else {})}, f, indent=1)


if __name__ == "__main__":
    main()
