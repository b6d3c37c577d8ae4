"""The calculator task's report (scripts/tool_task.sh): the GRPO run in a few lines, then held-out accuracy of the
model without a tool, the tool-SFT model and the GRPO model on the same problems, with paired differences.

    python scripts/show_tool_result.py WORK_DIR
"""

import json
import os
import sys

from show_result import every, paired_difference, read_jsonl

MODELS = ("sft_without_tool", "sft_with_tool", "grpo_with_tool")


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    work = sys.argv[1]
    print("\nGRPO with the calculator   step  score  tool calls  turns  generated tokens")
    for m in every(read_jsonl(os.path.join(work, "grpo", "metrics.jsonl")), 6):
        print(f"{'':<26} {m['step']:>5}  {m['critic/score/mean']:>5.3f}  {m['multi_turn/tool_calls_per_trajectory']:>10.2f}  "
              f"{m['num_turns/mean']:>5.2f}  {m['response_length/mean']:>16.1f}")
    print("\nHeld-out multiplications, greedy: accuracy ± standard error")
    print(f"{'model':<18} {'n':>5} {'acc':>7} {'± se':>7} {'tool calls':>10}")
    accuracy = {}
    for name in MODELS:
        rows = read_jsonl(os.path.join(work, "eval", f"{name}.jsonl"))
        with open(os.path.join(work, "eval", f"{name}.json")) as f:
            (figures,) = json.load(f).values()
        accuracy[name] = figures["acc"]
        calls = sum(r.get("tool_calls", 0) for r in rows) / len(rows)
        print(f"{name:<18} {figures['n']:>5} {figures['acc']:>7.3f} {figures['acc_se']:>7.3f} {calls:>10.2f}")
    path = lambda name: os.path.join(work, "eval", f"{name}.jsonl")  # noqa: E731
    for before in ("sft_with_tool", "sft_without_tool"):
        gain, se = paired_difference(path(before), path("grpo_with_tool"))
        print(f"grpo_with_tool - {before} on the same problems: {gain:+.3f} ± {se:.3f} ({gain / se if se else 0.0:+.1f} standard errors)")
    ratio = accuracy["grpo_with_tool"] / accuracy["sft_without_tool"] if accuracy["sft_without_tool"] else float("inf")
    print(f"grpo_with_tool / sft_without_tool: {ratio:.1f}x")
    print(f"\ntrajectories: {work}/grpo/rollouts/*.jsonl; answers (turn by turn): {work}/eval/*.jsonl")


if __name__ == "__main__":
    main()
