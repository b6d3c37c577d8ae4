"""A synthetic generative-recommendation task with MiniOneRec's mechanics (../shared/research/minionerec.md,
section 8): 256 items named by semantic IDs of three codes, `<a_i><b_j><c_k>`, from codebooks of 8 (24 new
tokens); users whose next item follows a latent rule.

    python scripts/make_recommendation_data.py OUT_DIR [--train 3000] [--val 200] [--test 500] [--seed 0]
        [--windows] [--preference TAU]

Catalog: each (a, b) pair has 4 random c codes (256 items; the third level is sparse, so the catalog's prefix tree
matters), and within a leaf the 4 items' popularity is a random order of .4/.3/.2/.1. A user has a style b_u and a
start code a_0 (uniform over 8); each next item's a is a + 1 mod 8 with probability .6, the same a with .25, a
uniform one with .15; its b is b_u with probability .8, else uniform; its c is drawn by the leaf's popularity. A
history holds 3 to 6 items, then the target. Splits hold disjoint users. Writes:
- items.index.json: MiniOneRec's index (item id -> its three code tokens): model.added_tokens_file and
  rollout.catalog_file;
- sft_{split}.parquet: a `messages` column (the history as the user's turn, the target as the assistant's);
- rl_{split}.parquet: verl's layout (`prompt`, `data_source` "recommendation", `reward_model.ground_truth` the target,
  `extra_info.history` the history's items).

--windows: the training users' SFT rows are sliding windows, as MiniOneRec's are: every item of a history after the
first is a target too, the items before it its history (a user of 3 to 6 items and a target makes 3 to 6 rows).

--preference TAU: a reward that knows what the logs do not (issue 67). The items a user clicks (histories, training
targets) follow each leaf's popularity as above; what satisfies them follows a quality order over the 8 c codes,
one for the whole catalog (drawn from the seed): within a leaf, item c with weight exp(quality(c) / TAU).
Validation and test targets are drawn from that preference; preference.json holds it, and
scripts/preference_reward.py scores a response by the user's probability of it under it.
"""

import argparse
import json
import math
import os
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq

CODES = 8
POPULARITY = (0.4, 0.3, 0.2, 0.1)
NEXT_A, SAME_A = 0.6, 0.25  # a user's next a: a + 1 mod 8, the same a, else uniform
STYLE_B = 0.8  # a user's b: their style, else uniform


def catalog(rng: random.Random) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """Each (a, b) leaf's 4 c codes with their popularity."""
    leaves = {}
    for a in range(CODES):
        for b in range(CODES):
            codes = rng.sample(range(CODES), 4)
            leaves[(a, b)] = list(zip(codes, rng.sample(POPULARITY, 4)))
    return leaves


def quality_order(seed: int) -> list[int]:
    """Each c code's quality (0 worst .. 7 best), one order for the whole catalog, drawn apart from the catalog and
    the users so that a seed's click data is the same with or without a preference."""
    return random.Random(f"quality-{seed}").sample(range(CODES), CODES)


def preferred(leaves: dict, quality: list[int], tau: float) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """The leaves with each item's weight its satisfaction's, exp(quality / tau) normalized within the leaf."""
    out = {}
    for leaf, codes in leaves.items():
        weights = [math.exp(quality[c] / tau) for c, _ in codes]
        out[leaf] = [(c, w / sum(weights)) for (c, _), w in zip(codes, weights)]
    return out


def sid(a: int, b: int, c: int) -> str:
    return f"<a_{a}><b_{b}><c_{c}>"


def item_codes(text: str) -> list[tuple[int, int, int]]:
    """The (a, b, c) codes of every item named in `text`, in order: sid's inverse."""
    return [(int(a), int(b), int(c)) for a, b, c in re.findall(r"<a_(\d+)><b_(\d+)><c_(\d+)>", text)]


def user_items(rng: random.Random, leaves: dict, target_leaves: dict | None = None) -> list[str]:
    """One user's history (3 to 6 items) and its target, last; the target's c drawn by `target_leaves`' weights
    where given (a user's preference), the others' by `leaves`' (their clicks)."""
    style, a = rng.randrange(CODES), rng.randrange(CODES)
    items = []
    length = rng.randint(3, 6)
    for step in range(length + 1):
        if step:
            draw = rng.random()
            a = (a + 1) % CODES if draw < NEXT_A else a if draw < NEXT_A + SAME_A else rng.randrange(CODES)
        b = style if rng.random() < STYLE_B else rng.randrange(CODES)
        codes, weights = zip(*(target_leaves if step == length and target_leaves else leaves)[(a, b)])
        items.append(sid(a, b, rng.choices(codes, weights)[0]))
    return items


def next_item_probabilities(history: list[tuple[int, int, int]], leaves: dict) -> dict[str, float]:
    """The generator's distribution of a user's next item given their history's (a, b, c) codes: the Bayes
    predictor, with the style's posterior from the history's b codes."""
    jump = (1 - NEXT_A - SAME_A) / CODES
    last_a = history[-1][0]
    p_a = [jump + NEXT_A * (a == (last_a + 1) % CODES) + SAME_A * (a == last_a) for a in range(CODES)]
    style = [math.prod(STYLE_B * (b == s) + (1 - STYLE_B) / CODES for _, b, _ in history) for s in range(CODES)]
    style = [p / sum(style) for p in style]
    p_b = [sum(style[s] * (STYLE_B * (b == s) + (1 - STYLE_B) / CODES) for s in range(CODES)) for b in range(CODES)]
    return {sid(a, b, c): p_a[a] * p_b[b] * weight for (a, b), codes in leaves.items() for c, weight in codes}


def prompt_text(history: list[str]) -> str:
    return "History: " + " ".join(history) + "\nNext:"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--train", type=int, default=3000)
    parser.add_argument("--val", type=int, default=200)
    parser.add_argument("--test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--windows", action="store_true", help="the training users' SFT rows: every position of a history a target")
    parser.add_argument("--preference", type=float, metavar="TAU", help="validation and test targets from a quality preference (above)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    leaves = catalog(rng)
    liked = None
    if args.preference is not None:
        quality = quality_order(args.seed)
        liked = preferred(leaves, quality, args.preference)
        with open(os.path.join(args.out, "preference.json"), "w") as f:
            json.dump({"tau": args.preference, "quality": quality, "clicks": [[a, b, codes] for (a, b), codes in sorted(leaves.items())],
                       "preference": [[a, b, codes] for (a, b), codes in sorted(liked.items())]}, f)
    index = {}
    for (a, b), codes in sorted(leaves.items()):
        for c, _ in codes:
            index[str(len(index))] = [f"<a_{a}>", f"<b_{b}>", f"<c_{c}>"]
    with open(os.path.join(args.out, "items.index.json"), "w") as f:
        json.dump(index, f)
    for split, users in (("train", args.train), ("val", args.val), ("test", args.test)):
        sft, rl = [], []
        for user in range(users):
            *history, target = user_items(rng, leaves, liked if split != "train" else None)
            # an empty system message: SmolLM2's template would add its 16-token default to every prompt
            turns = [{"role": "system", "content": ""}, {"role": "user", "content": prompt_text(history)}]
            windows = range(1, len(history) + 1) if args.windows and split == "train" else [len(history)]
            items = [*history, target]
            sft += [[{"role": "system", "content": ""}, {"role": "user", "content": prompt_text(items[:k])}, {"role": "assistant", "content": items[k]}]
                    for k in windows]
            rl.append({"prompt": turns, "data_source": "recommendation", "reward_model": {"ground_truth": target, "style": "rule"},
                       "extra_info": {"split": split, "index": user, "history": history}})
        pq.write_table(pa.table({"messages": sft}), os.path.join(args.out, f"sft_{split}.parquet"))
        pq.write_table(pa.Table.from_pylist(rl), os.path.join(args.out, f"rl_{split}.parquet"))
    print(f"wrote {len(index)} items, {args.train}/{args.val}/{args.test} users under {args.out}")


if __name__ == "__main__":
    main()
