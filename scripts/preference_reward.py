"""The preference task's reward (scripts/make_recommendation_data.py --preference): a response scores the user's
probability of being satisfied by it, given their history, under the generator's preference, which the click logs
the SFT learns from do not hold (0 for a response that is no item).

    custom_reward_function.path=scripts/preference_reward.py \
    +custom_reward_function.reward_kwargs.preference_file=DATA/preference.json
"""

import functools
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_recommendation_data as data  # noqa: E402


@functools.cache
def preferred_leaves(path: str) -> dict[tuple[int, int], list[tuple[int, float]]]:
    with open(path) as f:
        return {(a, b): [tuple(code) for code in codes] for a, b, codes in json.load(f)["preference"]}


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict, preference_file: str) -> float:
    history = data.item_codes("".join(extra_info["history"]))
    probabilities = data.next_item_probabilities(history, preferred_leaves(preference_file))
    return probabilities.get(re.sub(r"\s", "", solution_str), 0.0)
