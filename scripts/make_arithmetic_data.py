"""Verifiable arithmetic tasks as SFT and RL parquet files, or a GSM8K-style file converted to both layouts.

    python scripts/make_arithmetic_data.py OUT_DIR [--train 2000] [--val 200] [--test 500] [--reworded 0] [--seed 0] [--operations plus,minus,times] [--system TEXT] [--answer worked|short] [--no-instruction]
    python scripts/make_arithmetic_data.py OUT_DIR --from-gsm8k train.parquet [test.parquet ...]

Tasks mix addition, subtraction and multiplication of 1- to 3-digit numbers (or those of --operations), with the
answer after `####`.
Writes, for each split (train, val, test; or each GSM8K file by its name):
- sft_{split}.parquet: a `messages` column (user question, assistant answer: `a + b = n.\n#### n` worked, or with
  --answer short `#### n` alone, under a third of the tokens to generate and train on);
- rl_{split}.parquet: verl's layout (`prompt`, `data_source`, `reward_model` {ground_truth, style}, `extra_info`).
With --reworded N, a fourth split, `reworded`: N held-out problems asked in other words than the training
prompts' (other phrasings of the question and of the instruction, the answer still after `####`), to show that
what training taught is the arithmetic rather than one phrasing. No problem appears in two splits, whatever its
wording. With --no-instruction every prompt is its question alone (the SFT answers still teach the `####` format).
GSM8K-style input has `question` and `answer` columns, the answer ending `#### n`; its data_source is
openai/gsm8k, so the built-in strict `####` reward scores it.
With --system every chat starts with that system message: an empty one replaces a chat template's default
(SmolLM2's is 16 tokens, paid in every prefill, update and evaluation).
"""

import argparse
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTION = "Solve the problem and give the final answer after '####'."
OPERATIONS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
SYMBOLS = {"plus": "+", "minus": "-", "times": "*"}
ANSWERS = {"worked": "{a} {symbol} {b} = {result}.\n#### {result}", "short": "#### {result}"}
# the reworded split's phrasings: none shares the training prompts' "What is a plus b?" nor their instruction
REWORDED_QUESTIONS = {
    "plus": ["Add {a} and {b}.", "Find the sum of {a} and {b}.", "Compute {a} + {b}.", "How much is {b} added to {a}?",
             "Calculate {a} plus {b}."],
    "minus": ["Subtract {b} from {a}.", "Find the difference {a} - {b}.", "Compute {a} - {b}.", "How much is {a} take away {b}?",
              "Calculate {a} minus {b}."],
    "times": ["Multiply {a} by {b}.", "Find the product of {a} and {b}.", "Compute {a} * {b}.", "How much is {a} multiplied by {b}?",
              "Calculate {a} times {b}."],
}
REWORDED_INSTRUCTIONS = ["Write the result after '####'.", "End your reply with '####' followed by the number.",
                         "Show the calculation, then put the final number after '####'."]


def arithmetic_task(rng: random.Random, operations: list[str]) -> tuple[str, int, int]:
    """(operation, a, b)."""
    name = rng.choice(operations)
    digits = rng.choice([1, 2, 2, 3]) if name != "times" else rng.choice([1, 2])
    a, b = (rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1) for _ in range(2))
    return name, a, b


def worded(name: str, a: int, b: int, rng: random.Random | None, answer: str, instructed: bool) -> tuple[str, str, str]:
    """(prompt, answer ending '#### n' in the format ANSWERS[answer], n): in the training prompts' words, or with
    `rng` in one of the reworded split's; `instructed`: the question followed by an instruction to answer after
    '####'."""
    result = OPERATIONS[name](a, b)
    if rng is None:
        prompt = f"What is {a} {name} {b}?" + f" {INSTRUCTION}" * instructed
    else:
        question, instruction = rng.choice(REWORDED_QUESTIONS[name]).format(a=a, b=b), rng.choice(REWORDED_INSTRUCTIONS)
        prompt = question + f" {instruction}" * instructed
    return prompt, ANSWERS[answer].format(a=a, symbol=SYMBOLS[name], b=b, result=result), str(result)


def layouts(question: str, answer: str, ground_truth: str, data_source: str, split: str, index: int, system: str | None
            ) -> tuple[list, dict]:
    prompt = [{"role": "user", "content": question}]
    if system is not None:
        prompt.insert(0, {"role": "system", "content": system})
    messages = prompt + [{"role": "assistant", "content": answer}]
    rl = {"prompt": prompt, "data_source": data_source, "reward_model": {"ground_truth": ground_truth, "style": "rule"},
          "extra_info": {"split": split, "index": index}}
    return messages, rl


def write_split(out: str, split: str, rows: list[tuple[str, str, str]], data_source: str, system: str | None) -> None:
    made = [layouts(q, a, truth, data_source, split, i, system) for i, (q, a, truth) in enumerate(rows)]
    pq.write_table(pa.table({"messages": [m for m, _ in made]}), os.path.join(out, f"sft_{split}.parquet"))
    pq.write_table(pa.Table.from_pylist([rl for _, rl in made]), os.path.join(out, f"rl_{split}.parquet"))


def arithmetic_splits(sizes: dict[str, int], seed: int, operations: list[str], answer: str, instructed: bool
                      ) -> dict[str, list[tuple[str, str, str]]]:
    rng, seen, splits = random.Random(seed), set(), {}
    for split, size in sizes.items():
        rows = []
        while len(rows) < size:
            task = arithmetic_task(rng, operations)
            if task not in seen:  # no problem in two splits (nor twice in one)
                seen.add(task)
                rows.append(worded(*task, rng if split == "reworded" else None, answer, instructed))
        splits[split] = rows
    return splits


def gsm8k_rows(path: str) -> list[tuple[str, str, str]]:
    table = pq.read_table(path)
    missing = [c for c in ("question", "answer") if c not in table.column_names]
    if missing:
        raise SystemExit(f"{path}: missing column(s) {missing}; a GSM8K-style file has question and answer")
    rows = []
    for i, (question, answer) in enumerate(zip(table.column("question").to_pylist(), table.column("answer").to_pylist())):
        if not isinstance(answer, str) or "####" not in answer:
            raise SystemExit(f"{path} row {i}: the answer does not end with '#### n'")
        rows.append((f"{question} {INSTRUCTION}", answer, answer.split("####")[-1].strip().replace(",", "")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--val", type=int, default=200)
    parser.add_argument("--test", type=int, default=500)
    parser.add_argument("--reworded", type=int, default=0, help="held-out problems in other words (rl_reworded.parquet)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--operations", default="plus,minus,times", help="comma-separated, of: " + ", ".join(OPERATIONS))
    parser.add_argument("--system", help="a system message starting every chat (default: none, the chat template's own)")
    parser.add_argument("--answer", choices=sorted(ANSWERS), default="worked", help="the SFT answers' format (default: worked)")
    parser.add_argument("--no-instruction", action="store_true",
                        help="the question alone, without the instruction to answer after '####' (the SFT answers teach it)")
    parser.add_argument("--from-gsm8k", nargs="+", metavar="FILE", help="convert GSM8K-style files instead of generating tasks")
    args = parser.parse_args()
    operations = args.operations.split(",")
    unknown = sorted(set(operations) - set(OPERATIONS))
    if unknown:
        raise SystemExit(f"--operations: unknown {unknown}; choose from {', '.join(OPERATIONS)}")
    os.makedirs(args.out, exist_ok=True)
    if args.from_gsm8k:
        for path in args.from_gsm8k:
            split = os.path.splitext(os.path.basename(path))[0]
            write_split(args.out, split, gsm8k_rows(path), "openai/gsm8k", args.system)
    else:
        sizes = {"train": args.train, "val": args.val, "test": args.test} | ({"reworded": args.reworded} if args.reworded else {})
        for split, rows in arithmetic_splits(sizes, args.seed, operations, args.answer, not args.no_instruction).items():
            write_split(args.out, split, rows, "arithmetic", args.system)
    print(f"wrote sft_*.parquet and rl_*.parquet under {args.out}")


if __name__ == "__main__":
    main()
