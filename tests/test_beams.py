"""MiniOneRec's beam-search rollouts over a catalog (actor_rollout_ref.rollout.beam_search, catalog_file) and its
`rule` / `ranking` rewards (the item_rule and item_ranking verifiers): the hf engine's beams against transformers'
own beam search with a prefix constraint written here, the ranking penalties against the brief's hand-worked
figures, and a GRPO run through the CLI whose every response is a catalog item."""

import json
import math
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdptrain.data.micro_batches import collate_packed
from fsdptrain.models.attention import PACKED_ATTENTION
from fsdptrain.models.loss import token_log_probs
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rewards import item_ranking_verifier, item_rule_verifier, score_responses
from fsdptrain.rl.rollout.base import Generation
from fsdptrain.rl.rollout.hf import HFRollout, beam_search
from fsdptrain.rl.samples import make_samples
from fsdptrain.rl.sampling import with_answers
from fsdptrain.rl.validation import mean_and_se, ranking_values

from conftest import REPO, grpo_config_problems, read_metrics, torchrun
from test_grpo import grpo_args

ITEMS = ["apple pie", "apple tart", "banana", "cherry jam", "cherry", "date", "elder flower tea", "fig"]


def test_the_ranking_penalties_are_the_briefs():
    """G=16 with the target in the group: the wrong beams at ranks 0..3 get -.164, -.103, -.082, -.071 (the brief's
    figures, which sum to -1 over all 16 ranks); the target gets the rule's 1; a group without the target, 0."""
    group = [f"item{k}" for k in range(16)]
    group[5] = "target"
    scores = [item_ranking_verifier("rec", response, "target", {"group_responses": group, "group_rank": k}) for k, response in enumerate(group)]
    assert [round(s, 3) for s in scores[:4]] == [-0.164, -0.103, -0.082, -0.071]
    assert scores[5] == 1.0
    assert sum(s for k, s in enumerate(scores) if k != 5) == pytest.approx(-1 + 1 / math.log2(7) / sum(1 / math.log2(k + 2) for k in range(16)))
    missing = [f"item{k}" for k in range(16)]
    assert all(item_ranking_verifier("rec", r, "target", {"group_responses": missing, "group_rank": k}) == 0 for k, r in enumerate(missing))
    assert item_rule_verifier("rec", ' "<a_1><b_2>"\n', "<a_1><b_2>") == 1.0 and item_rule_verifier("rec", "<a_1>", "<a_1><b_2>") == 0.0


def test_a_responses_group_reaches_its_reward(tokenizer):
    """score_responses gives each reward its group's texts in rollout order and its place there."""
    texts = ["banana", "fig", "date", "fig"]
    responses = [Generation([1], tokenizer(t, add_special_tokens=False)["input_ids"], [1], None, False) for t in texts]
    prompts = [Prompt([1], [], "rec", "fig"), Prompt([1], [], "rec", "banana")]
    seen = []

    def reward(data_source, solution, ground_truth, extra_info):
        seen.append((extra_info["group_responses"], extra_info["group_rank"]))
        return item_ranking_verifier(data_source, solution, ground_truth, extra_info)

    scores = score_responses(reward, tokenizer, prompts, responses, [0, 0, 1, 1], "test: ")
    assert seen == [(["banana", "fig"], 0), (["banana", "fig"], 1), (["date", "fig"], 0), (["date", "fig"], 1)]
    weights = [1, 1 / math.log2(3)]
    assert [s["score"] for s in scores] == pytest.approx([-1 / sum(weights), 1.0, 0.0, 0.0])


@pytest.fixture(scope="module")
def catalog_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("catalog") / "items.txt"
    path.write_text("\n".join(ITEMS) + "\n")
    return str(path)


@pytest.mark.parametrize("n", [4, 8])
def test_the_engines_beams_are_transformers_constrained_beam_search(tiny_llama, catalog_file, n):
    """The engine's own search (each prompt forwarded once, not once per beam) against transformers' generate, with
    4 beams; with as many beams as items (more than the items' first tokens: some beams have nowhere to go at first),
    every item once, ordered by its log-prob from a plain forward, where transformers' search repeats items."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, tokenizer.pad_token_id, beams=True, catalog_file=catalog_file)
    prompts = [tokenizer(text)["input_ids"] for text in ("Recommend something sweet:", "Next item, please")]
    generations = engine.generate(prompts, n=n, max_new_tokens=8, batch_size=2 * n)
    assert [g.prompt_ids for g in generations] == [p for p in prompts for _ in range(n)]
    # The reference: transformers' beam search, constrained by a tree written here from the items' token ids.
    end = tokenizer.eos_token_id
    sequences = [tokenizer(item, add_special_tokens=False)["input_ids"] + [end] for item in ITEMS]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    width, pad = max(map(len, prompts)), tokenizer.pad_token_id  # both prompts in one search (batch_size 8 = 2 x 4 beams), left-padded

    def allowed(batch_id, ids):
        done = ids[width:].tolist()
        following = {s[len(done)] for s in sequences if len(s) > len(done) and s[: len(done)] == done}
        return sorted(following) or [end]

    output = model.generate(torch.tensor([[pad] * (width - len(p)) + p for p in prompts]),
                            attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]), num_beams=n,
                            num_return_sequences=n, do_sample=False, length_penalty=0.0, early_stopping=True, max_new_tokens=8,
                            eos_token_id=end, pad_token_id=pad, prefix_allowed_tokens_fn=allowed)
    expected = [row[: row.index(end) + 1] for row in output[:, width:].tolist()]
    repeated = [len({tuple(ids) for ids in expected[n * k : n * k + n]}) < n for k in range(len(prompts))]
    assert any(repeated) == (n == len(ITEMS))  # transformers' search repeats items where beams outnumber first tokens
    for k, prompt in enumerate(prompts):
        mine = [g.response_ids for g in generations[n * k : n * k + n]]
        assert all(ids in sequences for ids in mine) and len({tuple(ids) for ids in mine}) == n  # distinct catalog items
        if n < len(ITEMS):
            assert mine == expected[n * k : n * k + n]
            continue
        with torch.no_grad():
            scores = [model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).sum().item()
                      for ids in sequences]
        assert mine == [sequences[i] for i in sorted(range(len(sequences)), key=lambda i: -scores[i])]


def test_unconstrained_beams_are_transformers_beam_search(tiny_llama):
    """Without a catalog, over the whole vocabulary with two end tokens, beams ending at different lengths and the
    rest cut at the length limit: the same beams, best first, as generate's."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompts = [tokenizer(text)["input_ids"] for text in ("Recommend something sweet:", "Next item, please", "a")]
    with torch.no_grad():  # end tokens the model is likely to choose early, so that some beams end before the limit
        likely = model(torch.tensor([prompts[0]])).logits[0, -1].topk(3).indices.tolist()
    ends, pad, width = sorted(likely[1:]), tokenizer.pad_token_id, max(map(len, prompts))
    mine = beam_search(model, prompts, 5, 6, ends, pad, None, batch_size=15)
    output = model.generate(torch.tensor([[pad] * (width - len(p)) + p for p in prompts]),
                            attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]), num_beams=5,
                            num_return_sequences=5, do_sample=False, length_penalty=0.0, early_stopping=True, max_new_tokens=6,
                            eos_token_id=ends, pad_token_id=pad)
    expected = []
    for row in output[:, width:].tolist():
        end = next((i for i, token in enumerate(row) if token in ends), None)
        expected.append((row if end is None else row[: end + 1], end is None))
    assert [(g.response_ids, g.truncated) for g in mine] == expected
    assert {g.truncated for g in mine} == {True, False}


def test_the_folders_generation_config_takes_no_part_in_the_beams(tmp_path, tiny_llama, catalog_file):
    """A folder as an instruct model ships it (Qwen2.5-Instruct's generation_config.json: a repetition penalty,
    sampling settings, two end tokens): the engine's beams are still plain log-prob beams, transformers' constrained
    search with none of it on the folder without them, each item ending with the one end token, so coming once."""
    import shutil

    from transformers import GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [tokenizer(text)["input_ids"] for text in ("Recommend something sweet:", "cherry cherry cherry jam, then")]
    sequences = [tokenizer(item, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for item in ITEMS]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    # the second end token: the one the model likes best after an item, so that an item ending with it would take a beam
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + sequences[0][:-1]])).logits[0, -1]
    logits[[token for ids in sequences for token in ids]] = float("-inf")
    end, other_end = tokenizer.eos_token_id, int(logits.argmax())
    folder = tmp_path / "instruct"
    shutil.copytree(tiny_llama, folder)
    GenerationConfig(repetition_penalty=1.05, do_sample=True, temperature=0.7, top_k=20, top_p=0.8, eos_token_id=[end, other_end],
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)
    engine = HFRollout(str(folder), torch.device("cpu"), torch.float32, tokenizer.pad_token_id, beams=True, catalog_file=catalog_file)

    def constraint(width: int):
        def allowed(batch_id, ids):
            done = ids[width:].tolist()
            return sorted({s[len(done)] for s in sequences if len(s) > len(done) and s[: len(done)] == done}) or [end]

        return allowed

    generations = engine.generate(prompts, n=4, max_new_tokens=8, batch_size=4)
    for k, prompt in enumerate(prompts):
        output = model.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, do_sample=False, repetition_penalty=1.0,
                                length_penalty=0.0, early_stopping=True, max_new_tokens=8, eos_token_id=end, pad_token_id=tokenizer.pad_token_id,
                                prefix_allowed_tokens_fn=constraint(len(prompt)))
        expected = [row[: row.index(end) + 1] for row in output[:, len(prompt):].tolist()]
        assert [g.response_ids for g in generations[4 * k : 4 * k + 4]] == expected
        assert len({tuple(g.response_ids) for g in generations[4 * k : 4 * k + 4]}) == 4
    assert all(end in engine.catalog[tuple(ids[:-1])] for ids in sequences)  # an item ends one way
    assert not any(other_end in allowed for allowed in engine.catalog.values())


@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared-prompts", "one-row-each"])
def test_the_trainers_log_probs_of_beams_are_a_plain_forward(tiny_llama, catalog_file, share_prompts):
    """The beams of a batched, left-padded search made into training samples (make_samples) and forwarded as the
    trainer forwards them (packed rows, the prompt once a group or once a response, chunked log-softmax): each
    response token's log-prob equals a plain transformers forward of the unpadded prompt and beam."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, tokenizer.pad_token_id, beams=True, catalog_file=catalog_file)
    prompts = [tokenizer(text)["input_ids"] for text in ("Recommend something sweet:", "Next item, please")]
    generations = engine.generate(prompts, n=4, max_new_tokens=8, batch_size=8)
    samples = make_samples(generations, mask_truncated=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation=PACKED_ATTENTION, dtype=torch.float32)
    batch = collate_packed(samples, share_prefixes=share_prompts)
    with torch.no_grad():
        log_probs, _ = token_log_probs(model, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=7, token_rows=batch.token_rows)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation="eager")
    start = 0
    for generation in generations:
        ids = generation.prompt_ids + generation.response_ids
        with torch.no_grad():
            expected = plain(torch.tensor([ids])).logits[0].log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        prompt, response = len(generation.prompt_ids), len(generation.response_ids)
        mine = log_probs[start + prompt - 1 : start + prompt - 1 + response]  # the log-prob of token t+1 sits at t
        torch.testing.assert_close(mine, expected[prompt - 1 :], rtol=1e-5, atol=1e-5)
        start += len(ids)
    assert start == len(log_probs)


def test_constrained_sampling_answers_with_items_and_the_trainers_log_probs(tiny_llama, catalog_file):
    """A catalog without beams constrains sampling (temperature 1.3, top-k 50): every response is an item and an end
    token, both sampled responses and the engine's log-prob of each token is the unconstrained softmax's (the
    trainer's, which does not renormalize), from a plain transformers forward."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, tokenizer.pad_token_id, catalog_file=catalog_file)
    prompts = [tokenizer(text)["input_ids"] for text in ("Recommend something sweet:", "Next item, please")]
    torch.manual_seed(0)
    generations = engine.generate(prompts, n=16, max_new_tokens=8, batch_size=32, temperature=1.3, top_k=50, calculate_log_probs=True)
    end = tokenizer.eos_token_id
    sequences = [tokenizer(item, add_special_tokens=False)["input_ids"] + [end] for item in ITEMS]
    assert all(g.response_ids in sequences for g in generations)
    assert len({tuple(g.response_ids) for g in generations}) > 2  # sampled, not one greedy answer
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    for g in generations:
        ids = g.prompt_ids + g.response_ids
        with torch.no_grad():
            expected = (plain(torch.tensor([ids])).logits[0, :-1] / 1.3).log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(g.log_probs), expected[len(g.prompt_ids) - 1 :], rtol=1e-5, atol=1e-5)


def test_beam_settings_that_cannot_work_are_refused(catalog_file):
    assert "actor_rollout_ref.rollout.name=vllm takes no prefix constraint here (engines that do: hf)" in grpo_config_problems(
        f"actor_rollout_ref.rollout.catalog_file={catalog_file}", "actor_rollout_ref.rollout.name=vllm")
    assert "the catalog constrains a one-turn answer" in grpo_config_problems(f"actor_rollout_ref.rollout.catalog_file={catalog_file}",
                                                                               "actor_rollout_ref.rollout.multi_turn.enable=true")
    assert "name=vllm has no beam search here (engines that do: hf)" in grpo_config_problems("actor_rollout_ref.rollout.beam_search=true", "actor_rollout_ref.rollout.name=vllm")
    assert "gives no sampling log-probs" in grpo_config_problems("actor_rollout_ref.rollout.beam_search=true",
                                                                 "actor_rollout_ref.rollout.calculate_log_probs=true")
    assert "add_gt=true puts a response no engine sampled" in grpo_config_problems("actor_rollout_ref.rollout.add_gt=true",
                                                                                  "actor_rollout_ref.rollout.calculate_log_probs=true")
    assert "no_such.txt' does not exist" in grpo_config_problems("actor_rollout_ref.rollout.beam_search=true",
                                                                 "actor_rollout_ref.rollout.catalog_file=no_such.txt")


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "beam_pg"])
def test_grpo_over_constrained_beams_answers_with_catalog_items(tmp_path, tiny_llama, rl_data, estimator):
    """The arithmetic prompts, the catalog their answers and some distractors, the ranking reward alone, add_gt:
    every response of every group is a catalog item and an end token, each group's 4 beams distinct and the
    ground truth among them; validation logs HR@1 and NDCG@1. beam_pg's advantages sum to 0 in each group, the
    best-rewarded beam's at least 0, the worst's at most."""
    answers = sorted({str(row["reward_model"]["ground_truth"]) for split in ("train", "val")
                      for row in pq.read_table(rl_data / f"rl_{split}.parquet").to_pylist()})
    catalog = tmp_path / "answers.txt"
    catalog.write_text("\n".join([*answers, "0", "1", "2", "3"]) + "\n")
    out = str(tmp_path / "run")
    sources = '[{name:ranking,function:item_ranking,weight:1.0}]'
    args = grpo_args(tiny_llama, rl_data, out, actor_rollout_ref__rollout__beam_search="true", actor_rollout_ref__rollout__catalog_file=str(catalog),
                     custom_reward_function__path="null", reward__sources=sources, trainer__rollout_data_dir=f"{out}/rollouts",
                     actor_rollout_ref__rollout__val_kwargs__n=4, trainer__test_freq=2, actor_rollout_ref__rollout__add_gt="true",
                     algorithm__adv_estimator=estimator)
    torchrun(2, "fsdptrain.grpo_trainer", args)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    # validation searched 4 beams a prompt under the same constraint: HR@1 and NDCG@1 (the cut-offs within 4 beams)
    assert 0 <= metrics[1]["val-core/arithmetic/hr@1"] == metrics[1]["val-core/arithmetic/ndcg@1"] <= 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    items = {tuple(tokenizer(item, add_special_tokens=False)["input_ids"]) for item in catalog.read_text().split()}
    for step in (1, 2):
        rows = [json.loads(line) for line in open(os.path.join(out, "rollouts", f"{step}.jsonl"))]
        assert len(rows) == 16
        for row in rows:
            assert tuple(row["response_ids"][:-1]) in items and row["response_ids"][-1] == tokenizer.eos_token_id, row["response_ids"]
        for first in range(0, 16, 4):
            group = rows[first : first + 4]
            assert len({tuple(r["response_ids"]) for r in group}) == 4
            answer = tokenizer(str(group[0]["ground_truth"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            assert answer in [r["response_ids"] for r in group]  # add_gt: the ground truth is in every group
            if estimator == "beam_pg":
                advantages, rewards = [r["advantage"] for r in group], [r["seq_reward"] for r in group]
                assert sum(advantages) == pytest.approx(0, abs=1e-6)
                assert advantages[rewards.index(max(rewards))] >= 0 >= advantages[rewards.index(min(rewards))]


@pytest.mark.slow
def test_grpo_samples_constrained_to_a_catalog(tmp_path, tiny_llama, rl_data):
    """Sampling (not beams) constrained to the arithmetic answers and some distractors: every response of the
    run is a catalog item and an end token, and the engine's log-probs are the trainer's (no renormalization on
    either side: their largest difference stays at rounding)."""
    answers = sorted({str(row["reward_model"]["ground_truth"]) for row in pq.read_table(rl_data / "rl_train.parquet").to_pylist()})
    catalog = tmp_path / "answers.txt"
    catalog.write_text("\n".join([*answers, "0", "1", "2", "3"]) + "\n")
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, actor_rollout_ref__rollout__catalog_file=str(catalog),
                                                    actor_rollout_ref__rollout__calculate_log_probs="true", data__val_files="null",
                                                    trainer__rollout_data_dir=f"{out}/rollouts"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    items = {tuple(tokenizer(item, add_special_tokens=False)["input_ids"]) for item in catalog.read_text().split()}
    for step in (1, 2):
        for row in (json.loads(line) for line in open(os.path.join(out, "rollouts", f"{step}.jsonl"))):
            assert tuple(row["response_ids"][:-1]) in items and row["response_ids"][-1] == tokenizer.eos_token_id, row["response_ids"]
    for m in read_metrics(out):
        assert m["training/rollout_probs_diff_max"] < 1e-4


def test_hit_rate_and_ndcg_are_calc_pys():
    """The first prompt's item is its third response: HR@1 0, HR@5 1, NDCG@5 1/log2(4); the second's is absent."""
    records = [{"index": 0, "ground_truth": "fig", "response": r} for r in ("date", "banana", " fig", "cherry")]
    records += [{"index": 1, "ground_truth": "date", "response": r} for r in ("fig", "banana", "apple pie", "cherry")]
    values = ranking_values(records, [1, 5])
    assert values == {0: {"hr@1": 0.0, "ndcg@1": 0.0, "hr@5": 1.0, "ndcg@5": 0.5}, 1: {"hr@1": 0.0, "ndcg@1": 0.0, "hr@5": 0.0, "ndcg@5": 0.0}}
    assert mean_and_se([values[i]["ndcg@5"] for i in values]) == pytest.approx((0.25, 0.25))


@pytest.mark.slow
def test_evaluate_reports_the_ranking_of_constrained_beams(tmp_path, tiny_llama, catalog_file):
    """`fsdptrain.evaluate --beams 4 --catalog`: every prompt answered by 4 distinct catalog items, the printed HR@K and
    NDCG@K those of its answer file, and a paired difference of a model with itself of 0."""
    rows = [{"prompt": [{"role": "user", "content": f"Recommend item {i}"}], "data_source": "rec",
             "reward_model": {"style": "rule", "ground_truth": ITEMS[i % len(ITEMS)]}, "extra_info": {"index": i}} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "rec.parquet"))
    command = [sys.executable, "-m", "fsdptrain.evaluate", tiny_llama, str(tmp_path / "rec.parquet"), "--beams", "4", "--catalog", catalog_file,
               "--max-new-tokens", "8", "--out", str(tmp_path / "a.jsonl")]
    first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
    second = subprocess.run([*command[:-1], str(tmp_path / "b.jsonl"), "--paired-with", str(tmp_path / "a.jsonl")], cwd=REPO, capture_output=True,
                            text=True, check=True)
    answers = [json.loads(line) for line in open(tmp_path / "a.jsonl")]
    assert len(answers) == 24
    for i in range(6):
        mine = [a["response"] for a in answers if a["index"] == i]
        assert len(set(mine)) == 4 and set(mine) <= set(ITEMS), mine
    ranks = [next((r for r, a in enumerate([a for a in answers if a["index"] == i]) if a["response"] == ITEMS[i % len(ITEMS)]), None)
             for i in range(6)]
    hits = sum(r is not None and r < 1 for r in ranks) / 6
    printed = {line.split()[0]: line.split()[1:] for line in first.stdout.splitlines() if line.startswith(("hr@", "ndcg@"))}
    assert set(printed) == {"hr@1", "ndcg@1"} and float(printed["hr@1"][0]) == pytest.approx(hits, abs=1e-4)
    paired = {line.split()[0]: line.split()[1:] for line in second.stdout.splitlines() if line.startswith(("hr@", "ndcg@"))}
    assert float(paired["ndcg@1"][2]) == 0.0 and float(paired["ndcg@1"][3]) == 0.0


def test_add_gt_puts_the_answer_in_place_of_a_groups_last_member():
    generations = [Generation([7], ids, [1] * len(ids), None, False) for ids in ([1, 0], [2, 0], [3, 0], [4, 0])]
    prompts = [Prompt([7], [], "rec", "a"), Prompt([7], [], "rec", "b")]
    answers = {"a": [2, 0], "b": [9, 9, 0]}
    kept = with_answers(generations, prompts, 2, lambda prompt: answers[prompt.ground_truth])
    assert [g.response_ids for g in kept] == [[1, 0], [2, 0], [3, 0], [9, 9, 0]]
    assert kept[3].prompt_ids == [7] and kept[3].response_mask == [1, 1, 1] and not kept[3].truncated
