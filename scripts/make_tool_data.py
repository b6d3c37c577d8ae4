"""Multiplication of 2- and 3-digit numbers with a calculator tool, as SFT transcripts and RL parquet files.

    python scripts/make_tool_data.py OUT_DIR [--train 2000] [--val 64] [--test 200] [--seed 1]

Writes:
- sft_tool_{train,val}.parquet: `messages` (the question; the assistant's calculator call; the tool's result; the
  assistant's answer ending `#### n`), the transcripts a short SFT teaches the tool's use from;
- rl_{train,val,test}.parquet: verl's layout, the questions with the tool's instruction (data_source arithmetic:
  the built-in strict `#### n` reward);
- rl_test_plain.parquet: the same test questions as the quickstart asks them (no tool), for the model without one;
- calculator_tool.yaml: verl's tool YAML for actor_rollout_ref.rollout.multi_turn.tool_config_path and
  `python -m fsdptrain.evaluate --tool-config`.
No question appears in two splits.
"""

import argparse
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from make_arithmetic_data import INSTRUCTION

from fsdptrain.rl.agent.tools import CalculatorTool

TOOL_INSTRUCTION = ('Use the calculator: write <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call> '
                    "and read its result, then give the final answer after '####'.")


def call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def problems(sizes: dict[str, int], seed: int) -> dict[str, list[tuple[int, int]]]:
    rng, seen, splits = random.Random(seed), set(), {}
    for split, size in sizes.items():
        rows = []
        while len(rows) < size:
            a, b = rng.randint(10, 999), rng.randint(10, 999)
            if (a, b) not in seen and max(a, b) >= 100:  # at least one 3-digit factor
                seen.add((a, b))
                rows.append((a, b))
        splits[split] = rows
    return splits


def rl_row(question: str, answer: int, split: str, index: int) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "data_source": "arithmetic",
            "reward_model": {"ground_truth": str(answer), "style": "rule"}, "extra_info": {"split": split, "index": index}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--val", type=int, default=64)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split, rows in problems({"train": args.train, "val": args.val, "test": args.test}, args.seed).items():
        questions = [(f"What is {a} times {b}? {TOOL_INSTRUCTION}", a * b) for a, b in rows]
        pq.write_table(pa.Table.from_pylist([rl_row(q, n, split, i) for i, (q, n) in enumerate(questions)]), os.path.join(args.out, f"rl_{split}.parquet"))
        if split == "test":
            plain = [rl_row(f"What is {a} times {b}? {INSTRUCTION}", a * b, split, i) for i, (a, b) in enumerate(rows)]
            pq.write_table(pa.Table.from_pylist(plain), os.path.join(args.out, "rl_test_plain.parquet"))
        else:
            chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": call(f"{a} * {b}")}, {"role": "tool", "content": str(n)},
                      {"role": "assistant", "content": f"{a} * {b} = {n}.\n#### {n}"}] for (q, n), (a, b) in zip(questions, rows)]
            pq.write_table(pa.table({"messages": chats}), os.path.join(args.out, f"sft_tool_{split}.parquet"))
    tool = {"tools": [{"class_name": "fsdptrain.rl.agent.tools.CalculatorTool", "config": {}, "tool_schema": CalculatorTool.SCHEMA}]}
    with open(os.path.join(args.out, "calculator_tool.yaml"), "w") as f:
        yaml.safe_dump(tool, f, sort_keys=False)
    print(f"wrote {args.train} + {args.val} + {args.test} multiplications with a calculator to {args.out}")


if __name__ == "__main__":
    main()
