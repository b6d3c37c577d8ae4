"""Write multi-turn arithmetic chats as parquet (a `messages` column): learnable data whose lengths vary
like chat data (mostly short, a long tail).

    python scripts/demo_data.py OUT_DIR [--rows 256] [--seed 0]

writes OUT_DIR/train.parquet (ROWS rows) and OUT_DIR/val.parquet (ROWS/8 rows, at least 8).
"""

import argparse
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq


def arithmetic_conversation(rng: random.Random) -> list:
    messages = [{"role": "system", "content": "You add numbers."}] if rng.random() < 0.5 else []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 6])):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        messages.append({"role": "user", "content": f"What is {a} plus {b}?"})
        messages.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}."})
    return messages


def write_chat_parquet(path: str, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    pq.write_table(pa.table({"messages": [arithmetic_conversation(rng) for _ in range(rows)]}), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    write_chat_parquet(os.path.join(args.out, "train.parquet"), args.rows, args.seed)
    write_chat_parquet(os.path.join(args.out, "val.parquet"), max(8, args.rows // 8), args.seed + 1)
    print(f"wrote train.parquet and val.parquet under {args.out}")


if __name__ == "__main__":
    main()
