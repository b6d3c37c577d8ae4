"""Images whose answer is only in the image: a square of one colour on a background of another, and the question
"What colour is the square?", in verl's layouts (SFT: messages with an `<image>` mark and an `images` column; RL:
the prompt's messages, `images`, data_source `shape_colour`, the colour as ground truth), with the reward
function that scores an answer (1 where its first colour word is the square's).

    python scripts/make_shape_data.py OUT_DIR [--train 2000] [--test 500] [--seed 0] [--size 32]

Writes sft_train.parquet, rl_train.parquet, rl_test.parquet and reward.py. The test images are drawn after the
training ones, from the same seed: no test image is a training image.
"""

import argparse
import io
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40), "purple": (150, 60, 190),
           "orange": (240, 140, 30)}
QUESTION = "<image>What colour is the square?"
REWARD = f'''import re

COLOURS = {sorted(COLOURS)!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    words = re.findall(r"[a-z]+", solution_str.lower())
    said = next((word for word in words if word in COLOURS), None)
    return {{"score": float(said == ground_truth), "acc": float(said == ground_truth)}}
'''


def shape_image(rng: random.Random, size: int) -> tuple[bytes, str]:
    """A square of one colour, 1/4 to 1/2 of the side, anywhere on a background of another (both jittered)."""
    colour, background = rng.sample(sorted(COLOURS), 2)
    jitter = lambda rgb: tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in rgb)  # noqa: E731
    image = Image.new("RGB", (size, size), jitter(COLOURS[background]))
    side = rng.randint(size // 4, size // 2)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=jitter(COLOURS[colour]))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue(), colour


def rows(rng: random.Random, count: int, size: int) -> list[tuple[bytes, str]]:
    return [shape_image(rng, size) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=32, help="the images' side in pixels")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    train, test = rows(rng, args.train, args.size), rows(rng, args.test, args.size)
    image = lambda png: [{"bytes": png, "path": None}]  # noqa: E731
    pq.write_table(pa.Table.from_pylist([
        {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": colour}], "images": image(png)}
        for png, colour in train]), os.path.join(args.out, "sft_train.parquet"))
    for name, split in (("rl_train", train), ("rl_test", test)):
        pq.write_table(pa.Table.from_pylist([
            {"prompt": [{"role": "user", "content": QUESTION}], "images": image(png), "data_source": "shape_colour",
             "reward_model": {"ground_truth": colour, "style": "rule"}, "extra_info": {"index": i}}
            for i, (png, colour) in enumerate(split)]), os.path.join(args.out, f"{name}.parquet"))
    with open(os.path.join(args.out, "reward.py"), "w") as f:
        f.write(REWARD)
    print(f"wrote {args.train} training and {args.test} test images to {args.out}")


if __name__ == "__main__":
    main()
