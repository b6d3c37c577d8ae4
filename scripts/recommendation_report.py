"""The report of a recommendation task's evaluations (scripts/recommend_task.sh, scripts/preference_task.sh): HR@K
and NDCG@K of the SFT model, each RL model's paired difference from it, the first RL model's from the equal-time
SFT control, and every model's figures expected under the generator (recommendation_oracle.py).

    python scripts/recommendation_report.py EVAL_DIR --control NAME MODEL [MODEL ...] [--seed 0] [--preference P]

EVAL_DIR holds sft.jsonl, NAME.jsonl and each MODEL.jsonl (`python -m fsdptrain.evaluate ... --beams 10 --out`, on
the same held-out users); --seed and --preference as recommendation_oracle.py's.
"""

import argparse
import json
import os

from recommendation_oracle import leaves_of, print_table

from fsdptrain.evaluate import report_ranking


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("eval_dir")
    parser.add_argument("models", nargs="+", help="the RL models' names, the first the one the control's wall time matched")
    parser.add_argument("--control", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preference")
    args = parser.parse_args()
    path = lambda name: os.path.join(args.eval_dir, f"{name}.jsonl")  # noqa: E731
    records = lambda name: [json.loads(line) for line in open(path(name))]  # noqa: E731
    print("sft:", end="")
    report_ranking(records("sft"), [1, 5, 10], None)
    for name in args.models:
        print(f"\n{name}, and its paired difference from sft:", end="")
        report_ranking(records(name), [1, 5, 10], path("sft"))
    print(f"\n{args.models[0]}, and its paired difference from the equal-time SFT control ({args.control}):", end="")
    report_ranking(records(args.models[0]), [1, 5, 10], path(args.control))
    leaves = leaves_of(args.seed, args.preference)
    for name in ["sft", *args.models, args.control]:  # expected under the generator's next item: no draw's noise
        print(f"\n== {name} against the generator's {'preference' if args.preference else 'clicks'}")
        print_table(path(name), leaves, 10)


if __name__ == "__main__":
    main()
