"""MiniOneRec's data as fsdptrain reads it: a user's own copy of MiniOneRec's item index and train/valid/test CSVs
become fsdptrain's SFT and RL parquet files, with MiniOneRec's prompt wording (its data.py: SidSFTDataset,
SidDataset, EvalSidDataset).

    python scripts/minionerec_to_parquet.py OUT_DIR --index Industrial_and_Scientific.index.json \
        --train train/Industrial_....csv --valid valid/Industrial_....csv --test test/Industrial_....csv

Each CSV row is one (history, next item) pair, as MiniOneRec's data processing writes them (every user's sequence
already cut into sliding windows of up to 10 items): `history_item_sid` a Python list literal of semantic IDs
(`<a_12><b_3><c_200>`), `item_sid` the next one; every other column is ignored. Writes into OUT_DIR:
- items.index.json: the index as given (model.added_tokens_file, rollout.catalog_file, evaluate.py --catalog);
- sft_train.parquet, sft_valid.parquet: a `messages` column, the user's turn MiniOneRec's SFT prompt (its instruction
  preamble, `### User Input:` with the history, `### Response:`), the assistant's the next item;
- rl_train.parquet: verl's layout (`prompt`, `data_source` "minionerec", `reward_model.ground_truth` the next item),
  the prompt MiniOneRec's RL wording (no preamble, as its rl.py reads SidDataset);
- rl_valid.parquet, rl_test.parquet: the same layout in MiniOneRec's evaluation wording (EvalSidDataset), for
  validation during RL and for evaluate.py.

Chosen: fsdptrain renders every row through the model's chat template where MiniOneRec feeds the raw text, so the
wording is MiniOneRec's and the turn markers the model's own, the same in SFT, RL and evaluation; the answer is the
item alone (MiniOneRec's adds a newline before the end token). The alignment tasks (title <-> SID, from the item
info file) are not converted. Data licence: the Amazon-derived files are the user's own; none ships here.
"""

import argparse
import ast
import csv
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

PREAMBLE = ("Below is an instruction that describes a task, paired with an input that provides further context. Write a response "
            "that appropriately completes the request. \n\n### Instruction:\nCan you predict the next possible item that the user may expect?\n\n")


def user_input(text: str) -> str:
    """MiniOneRec's generate_prompt with an empty output."""
    return f"### User Input: \n{text}\n\n### Response:\n"


def training_input(history: list[str]) -> str:
    return (f"The user has interacted with items {', '.join(history)} in chronological order. Can you predict the next possible item "
            "that the user may expect?")


def sft_prompt(history: list[str]) -> str:
    return PREAMBLE + user_input(training_input(history))


def rl_prompt(history: list[str]) -> str:
    return user_input(training_input(history))


def eval_prompt(history: list[str]) -> str:
    return PREAMBLE + user_input(f"Can you predict the next possible item the user may expect, given the following chronological interaction "
                                 f"history: {', '.join(history)}")


def read_pairs(path: str, items: set[str]) -> list[tuple[list[str], str]]:
    """Each row's (history, next item), every item checked against the index; an error names the file and row."""
    pairs = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"history_item_sid", "item_sid"} - set(reader.fieldnames or ())
        if missing:
            raise SystemExit(f"{path}: missing column(s) {sorted(missing)}; the file has {reader.fieldnames}")
        for row, record in enumerate(reader):
            try:
                history = ast.literal_eval(record["history_item_sid"])
            except (ValueError, SyntaxError):
                raise SystemExit(f"{path} row {row}: history_item_sid is not a list literal: {record['history_item_sid'][:100]!r}") from None
            target = record["item_sid"]
            history = history if isinstance(history, list) else []
            unknown = [item for item in [*history, target] if item not in items]
            if not history or unknown:
                raise SystemExit(f"{path} row {row}: a history of items and a next item from the index are needed; "
                                 f"{'not in the index: ' + ', '.join(unknown) if unknown else 'the history is empty'}")
            pairs.append((history, target))
    return pairs


def rl_rows(pairs: list[tuple[list[str], str]], prompt, split: str) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": prompt(history)}], "data_source": "minionerec",
             "reward_model": {"ground_truth": target, "style": "rule"}, "extra_info": {"split": split, "index": i}}
            for i, (history, target) in enumerate(pairs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--index", required=True, help="MiniOneRec's *.index.json: item id -> its code tokens")
    parser.add_argument("--train", required=True)
    parser.add_argument("--valid", required=True)
    parser.add_argument("--test", required=True)
    args = parser.parse_args()
    with open(args.index) as f:
        items = {"".join(tokens) for tokens in json.load(f).values()}
    os.makedirs(args.out, exist_ok=True)
    shutil.copyfile(args.index, os.path.join(args.out, "items.index.json"))
    splits = {name: read_pairs(path, items) for name, path in (("train", args.train), ("valid", args.valid), ("test", args.test))}
    for name in ("train", "valid"):
        messages = [[{"role": "user", "content": sft_prompt(history)}, {"role": "assistant", "content": target}] for history, target in splits[name]]
        pq.write_table(pa.table({"messages": messages}), os.path.join(args.out, f"sft_{name}.parquet"))
    pq.write_table(pa.Table.from_pylist(rl_rows(splits["train"], rl_prompt, "train")), os.path.join(args.out, "rl_train.parquet"))
    for name in ("valid", "test"):
        pq.write_table(pa.Table.from_pylist(rl_rows(splits[name], eval_prompt, name)), os.path.join(args.out, f"rl_{name}.parquet"))
    print(f"wrote {len(items)} items; {', '.join(f'{len(pairs)} {name} rows' for name, pairs in splits.items())} under {args.out}")


if __name__ == "__main__":
    main()
