"""scripts/make_recommendation_data.py: the catalog and users of MiniOneRec's brief, section 8."""

import json
import random
import re
import shutil
import subprocess
import sys
from collections import Counter

import pyarrow.parquet as pq
import pytest

from conftest import REPO


def test_the_catalog_and_the_users_follow_the_brief(tmp_path):
    subprocess.run([sys.executable, "scripts/make_recommendation_data.py", str(tmp_path), "--train", "400", "--val", "20", "--test", "30"],
                   cwd=REPO, check=True, capture_output=True)
    index = json.loads((tmp_path / "items.index.json").read_text())
    assert len(index) == 256 and len({tuple(t) for t in index.values()}) == 256
    assert len({token for tokens in index.values() for token in tokens}) == 24  # codebooks of 8/8/8
    leaves = Counter((a, b) for a, b, _ in index.values())
    assert set(leaves.values()) == {4} and len(leaves) == 64  # 4 c codes under every (a, b)
    items = {"".join(tokens) for tokens in index.values()}
    steps = advanced = 0
    for split, users in (("train", 400), ("val", 20), ("test", 30)):
        sft, rl = pq.read_table(tmp_path / f"sft_{split}.parquet").to_pylist(), pq.read_table(tmp_path / f"rl_{split}.parquet").to_pylist()
        assert len(sft) == len(rl) == users
        for chat, row in zip(sft, rl):
            history = re.findall(r"<a_\d><b_\d><c_\d>", chat["messages"][1]["content"])
            assert 3 <= len(history) <= 6 and set(history) <= items
            assert chat["messages"][2]["content"] == row["reward_model"]["ground_truth"] in items
            assert row["prompt"] == chat["messages"][:2] and chat["messages"][0] == {"role": "system", "content": ""}
            codes = [int(item[3]) for item in [*history, chat["messages"][2]["content"]]]
            steps += len(codes) - 1
            advanced += sum((b - a) % 8 == 1 for a, b in zip(codes, codes[1:]))
    assert 0.55 < advanced / steps < 0.7  # a moves to a + 1 with probability .6 (plus .15 / 8 by the uniform draw)


def test_the_bayes_predictor_is_calibrated_on_the_generators_users():
    """scripts/recommendation_oracle.py's reference: next_item_probabilities sums to 1 for every history, and on
    4000 users drawn by the generator the probability it gives the drawn target's rank classes matches how often
    the target falls in them (the Bayes ranking's top 1 and top 10, within 4 standard errors); the brief's oracle
    HR@10 is about 0.74."""
    import make_recommendation_data as data

    rng = random.Random(1)
    leaves = data.catalog(rng)
    expected, measured = {1: 0.0, 10: 0.0}, {1: 0, 10: 0}
    n = 4000
    for _ in range(n):
        *history, target = data.user_items(rng, leaves)
        probability = data.next_item_probabilities(data.item_codes("".join(history)), leaves)
        assert abs(sum(probability.values()) - 1) < 1e-9
        ranking = sorted(probability, key=probability.get, reverse=True)
        for k in expected:
            expected[k] += sum(probability[item] for item in ranking[:k]) / n
            measured[k] += (target in ranking[:k]) / n
    for k in expected:
        assert abs(measured[k] - expected[k]) < 4 * (expected[k] * (1 - expected[k]) / n) ** 0.5, (k, measured[k], expected[k])
    assert 0.72 < expected[10] < 0.76


def test_the_oracle_script_scores_the_bayes_ranking_as_bayes_and_its_reverse_lower(tmp_path):
    """scripts/recommendation_oracle.py on evaluation rows written by hand: beams that are the Bayes top 10 score
    as the Bayes ranking; the same 10 reversed keep the expected HR@10 and lose expected NDCG@10, which the reordered
    row gives back."""
    import make_recommendation_data as data

    rng = random.Random(0)
    leaves = data.catalog(rng)
    rows = {"bayes": [], "reversed": []}
    for user in range(50):
        *history, target = data.user_items(rng, leaves)
        probability = data.next_item_probabilities(data.item_codes("".join(history)), leaves)
        top = sorted(probability, key=probability.get, reverse=True)[:10]
        prompt = [{"role": "user", "content": data.prompt_text(history)}]
        for name, ranking in (("bayes", top), ("reversed", top[::-1])):
            rows[name] += [{"index": user, "prompt": prompt, "ground_truth": target, "response": item} for item in ranking]
    scores = {}
    for name, written in rows.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in written))
        out = subprocess.run([sys.executable, "scripts/recommendation_oracle.py", str(path), "--seed", "0"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout
        scores[name] = {line[:32].strip(): [float(x) for x in line[32:].split()] for line in out.splitlines()[2:]}
    bayes, reverse = scores["bayes"], scores["reversed"]
    assert bayes["model"] == bayes["Bayes"] == reverse["Bayes"]
    assert reverse["model's items in Bayes order"][2:] == bayes["model"][2:]  # expected figures: equal-probability items may swap
    assert reverse["model"][2] == bayes["model"][2] and reverse["model"][3] < bayes["model"][3] - 0.05
    # the task scripts' report: the Bayes rows as an RL model against the reversed ones as its SFT and its control
    for name, source in (("sft", "reversed"), ("rl", "bayes"), ("control", "reversed")):
        shutil.copy(tmp_path / f"{source}.jsonl", tmp_path / f"{name}.jsonl")
    out = subprocess.run([sys.executable, "scripts/recommendation_report.py", str(tmp_path), "rl", "--control", "control", "--seed", "0"],
                         cwd=REPO, check=True, capture_output=True, text=True).stdout
    differences = {}
    for section in out.split("\n\n")[1:3]:
        title, table = section.split(":", 1)
        differences[title] = {line.split()[0]: float(line.split()[3]) for line in table.strip().splitlines()[1:]}
    for title in ("rl, and its paired difference from sft", "rl, and its paired difference from the equal-time SFT control (control)"):
        assert differences[title]["hr@10"] == 0 and differences[title]["ndcg@10"] == pytest.approx(bayes["model"][1] - reverse["model"][1], abs=1e-4)
    assert out.count("== ") == 3 and "sft against the generator's clicks" in out


def test_the_preference_task_keeps_the_clicks_and_sizes_the_headroom(tmp_path):
    """--preference 1: the click data (the SFT rows, the training targets) is the seed's without it; held-out targets
    follow the quality order (the leaf's best item far more often than its popularity gives it); and on 1000 users
    the click Bayes ranking, the best an SFT on the clicks can learn, scores about 0.40 expected NDCG@10 under the
    preference, the preference's own ranking about 0.60 (issue 67's sizes)."""
    import make_recommendation_data as data
    import preference_reward
    from recommendation_oracle import hit_and_gain

    def make(out, *flags):
        subprocess.run([sys.executable, "scripts/make_recommendation_data.py", str(out), "--train", "50", "--val", "300", "--test", "5", *flags],
                       cwd=REPO, check=True, capture_output=True)

    make(tmp_path / "clicks")
    make(tmp_path / "liked", "--preference", "1")
    for split in ("train", "val"):
        clicks, liked = (pq.read_table(tmp_path / run / f"sft_{split}.parquet").to_pylist() for run in ("clicks", "liked"))
        histories = [[m["content"] for m in row["messages"][:2]] for row in clicks]
        assert histories == [[m["content"] for m in row["messages"][:2]] for row in liked]
        assert (clicks == liked) == (split == "train")
    leaves = preference_reward.preferred_leaves(str(tmp_path / "liked" / "preference.json"))
    best = {leaf: max(codes, key=lambda code: code[1])[0] for leaf, codes in leaves.items()}
    targets = [data.item_codes(row["reward_model"]["ground_truth"])[0] for row in pq.read_table(tmp_path / "liked" / "rl_val.parquet").to_pylist()]
    assert sum(best[(a, b)] == c for a, b, c in targets) / len(targets) > 0.6  # popularity alone gives the best item 0.25 on average

    rng = random.Random(0)
    clicks = data.catalog(rng)
    liked = data.preferred(clicks, data.quality_order(0), 1.0)
    gains = {"clicks": 0.0, "preference": 0.0}
    for _ in range(1000):
        history = data.item_codes("".join(data.user_items(rng, clicks)[:-1]))
        truth = data.next_item_probabilities(history, liked)
        for name, model in (("clicks", clicks), ("preference", liked)):
            probability = data.next_item_probabilities(history, model)
            gains[name] += hit_and_gain(sorted(probability, key=probability.get, reverse=True), truth, 10)[1] / 1000
    assert 0.36 < gains["clicks"] < 0.44 and 0.56 < gains["preference"] < 0.64, gains


def test_sliding_windows_make_every_history_position_a_target(tmp_path):
    subprocess.run([sys.executable, "scripts/make_recommendation_data.py", str(tmp_path), "--train", "20", "--val", "5", "--test", "5", "--windows"],
                   cwd=REPO, check=True, capture_output=True)
    sft, rl = pq.read_table(tmp_path / "sft_train.parquet").to_pylist(), pq.read_table(tmp_path / "rl_train.parquet").to_pylist()
    expected = []
    for row in rl:
        items = [*row["extra_info"]["history"], row["reward_model"]["ground_truth"]]
        expected += [(re.findall(r"<a_\d><b_\d><c_\d>", "".join(items[:k])), items[k]) for k in range(1, len(items))]
    assert [(re.findall(r"<a_\d><b_\d><c_\d>", chat["messages"][1]["content"]), chat["messages"][2]["content"]) for chat in sft] == expected
    assert pq.read_table(tmp_path / "sft_val.parquet").num_rows == 5  # held-out users: one row each


def test_the_preference_reward_is_the_users_probability_under_the_preference(tmp_path):
    """scripts/preference_reward.py through the trainer's loader with verl's reward_kwargs: a response's score is
    the generator's probability of it under the preference, 0 for what is no item; a keyword the function does not
    take is named before any work."""
    import make_recommendation_data as data

    from fsdptrain.rl.rewards import RewardError, load_reward_function

    subprocess.run([sys.executable, "scripts/make_recommendation_data.py", str(tmp_path), "--train", "5", "--val", "5", "--test", "5",
                    "--preference", "1"], cwd=REPO, check=True, capture_output=True)
    preference_file = str(tmp_path / "preference.json")
    score = load_reward_function(str(REPO / "scripts/preference_reward.py"), "compute_score", kwargs={"preference_file": preference_file})
    liked = data.preferred(data.catalog(random.Random(0)), data.quality_order(0), 1.0)
    row = pq.read_table(tmp_path / "rl_train.parquet").to_pylist()[0]
    probabilities = data.next_item_probabilities(data.item_codes("".join(row["extra_info"]["history"])), liked)
    for item in sorted(probabilities, key=probabilities.get)[-3:]:
        assert score("recommendation", f" {item}\n", row["reward_model"]["ground_truth"], row["extra_info"]) == pytest.approx(probabilities[item])
    assert score("recommendation", "no item", "", row["extra_info"]) == 0.0
    with pytest.raises(RewardError, match=r"custom_reward_function.reward_kwargs: .*cannot take \['preference_path'\]"):
        load_reward_function(str(REPO / "scripts/preference_reward.py"), "compute_score", kwargs={"preference_path": preference_file})
