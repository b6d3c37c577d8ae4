"""The quickstart's report: the SFT and GRPO runs in a few lines each, then the SFT and GRPO models' accuracy side
by side on each held-out set (the test split; problems worded otherwise), and where everything is.

    python scripts/show_result.py WORK_DIR
"""

import json
import os
import sys

from fsdptrain.rl.validation import mean_and_se


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def every(rows: list[dict], count: int) -> list[dict]:
    """About `count` rows spread over the run, the last included."""
    stride = max(len(rows) // count, 1)
    return [row for i, row in enumerate(rows) if i % stride == 0 or i == len(rows) - 1]


def paired_difference(before: str, after: str) -> tuple[float, float]:
    """Mean per-problem accuracy gain of `after` over `before` (evaluate's answer files, the same problems) and its
    standard error: the spread of the per-problem differences, which counts the problems both solve only once."""
    first = {r["index"]: r["acc"] for r in read_jsonl(before)}
    return mean_and_se([r["acc"] - first[r["index"]] for r in read_jsonl(after)])


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    work = sys.argv[1]
    print("\nSFT                 step  train/loss")
    for m in every(read_jsonl(os.path.join(work, "sft", "metrics.jsonl")), 4):
        print(f"{'':<18} {m['step']:>5}  {m['train/loss']:>10.4f}")
    print("\nGRPO                step  score  response tokens  zero-spread groups")
    for m in every(read_jsonl(os.path.join(work, "grpo", "metrics.jsonl")), 6):
        print(f"{'':<18} {m['step']:>5}  {m['critic/score/mean']:>5.3f}  {m['response_length/mean']:>15.1f}  {m['frac_reward_zero_std']:>18.2f}")
    for split, title in (("test", "Held-out test split"), ("reworded", "Held-out problems worded otherwise than the training prompts")):
        print(f"\n{title}, greedy: accuracy ± standard error")
        print(f"{'model':<8} {'n':>5} {'acc':>7} {'± se':>7} {'length':>7}")
        for name in ("sft", "grpo"):
            with open(os.path.join(work, "eval", f"{name}_{split}.json")) as f:
                for s in json.load(f).values():
                    print(f"{name:<8} {s['n']:>5} {s['acc']:>7.3f} {s['acc_se']:>7.3f} {s['response_length']:>7.1f}")
        gain, se = paired_difference(os.path.join(work, "eval", f"sft_{split}.jsonl"), os.path.join(work, "eval", f"grpo_{split}.jsonl"))
        print(f"GRPO - SFT on the same problems: {gain:+.3f} ± {se:.3f} ({gain / se if se else 0.0:+.1f} standard errors)")
    print(f"\nmodels: {work}/sft/global_step_*/huggingface, {work}/grpo/global_step_*/huggingface (transformers and vLLM load them)")
    print(f"metrics: {work}/sft/metrics.jsonl, {work}/grpo/metrics.jsonl; plots: {work}/sft/plots/, {work}/grpo/plots/; answers: {work}/eval/*_{{test,reworded}}.jsonl")


if __name__ == "__main__":
    main()
