"""A recommendation model's beams against the Bayes predictor of make_recommendation_data.py's generator: HR@K and
NDCG@K as measured (against each user's one drawn target) and as expected under the generator's distribution of the
next item (no draw: the noise of a few hundred targets gone), for the model's ranking, for the Bayes ranking, and for
the model's K items put in Bayes order (how much of the gap is the order and how much the set).

    python scripts/recommendation_oracle.py EVAL.jsonl [--seed 0] [--k 10] [--preference DATA/preference.json]

EVAL.jsonl: `python -m fsdptrain.evaluate ... --beams K --out EVAL.jsonl` on the data's rl_{val,test}.parquet; --seed
is the data's (it fixes the catalog's popularity). --preference: the data was made with --preference, and its
held-out targets follow the users' preference, not their clicks: expected figures are under that preference.
"""

import argparse
import json
import math
import os
import random
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_recommendation_data as data  # noqa: E402
import preference_reward  # noqa: E402


def hit_and_gain(ranking: list[str], probability: dict[str, float], k: int) -> tuple[float, float]:
    """Expected HR@k and NDCG@k of a ranking when the target is drawn from `probability`."""
    top = ranking[:k]
    return sum(probability.get(item, 0.0) for item in top), sum(probability.get(item, 0.0) / math.log2(i + 2) for i, item in enumerate(top))


def leaves_of(seed: int, preference: str | None) -> dict:
    """Each leaf's next-item weights: the clicks' popularity of the data's `seed`, or its preference.json's."""
    return preference_reward.preferred_leaves(preference) if preference else data.catalog(random.Random(seed))


def print_table(eval_jsonl: str, leaves: dict, k: int) -> None:
    """Measured and expected HR@k and NDCG@k of the model's beams, of the Bayes ranking, and of the model's items in
    Bayes order."""
    users = defaultdict(list)
    for line in open(eval_jsonl):
        row = json.loads(line)
        users[row["index"]].append(row)
    totals = defaultdict(float)
    for rows in users.values():
        history = data.item_codes(rows[0]["prompt"][-1]["content"])
        probability = data.next_item_probabilities(history, leaves)
        model = [row["response"] for row in rows]
        bayes = sorted(probability, key=probability.get, reverse=True)
        target = rows[0]["ground_truth"]
        for name, ranking in (("model", model), ("Bayes", bayes), ("model's items in Bayes order", sorted(model, key=lambda i: -probability.get(i, 0.0)))):
            hit, gain = hit_and_gain(ranking, probability, k)
            totals[name, "expected"] += hit
            totals[name, "expected ndcg"] += gain
            if target in ranking[:k]:
                totals[name, "measured"] += 1
                totals[name, "measured ndcg"] += 1 / math.log2(ranking.index(target) + 2)
    n = len(users)
    print(f"{n} users, K={k}")
    print(f"{'ranking':32s} {'HR@K':>8s} {'NDCG@K':>8s} {'expected HR@K':>14s} {'expected NDCG@K':>16s}")
    for name in ("model", "Bayes", "model's items in Bayes order"):
        print(f"{name:32s} {totals[name, 'measured'] / n:8.4f} {totals[name, 'measured ndcg'] / n:8.4f} "
              f"{totals[name, 'expected'] / n:14.4f} {totals[name, 'expected ndcg'] / n:16.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("eval_jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--preference", help="the data's preference.json (make_recommendation_data.py --preference)")
    args = parser.parse_args()
    print_table(args.eval_jsonl, leaves_of(args.seed, args.preference), args.k)


if __name__ == "__main__":
    main()
