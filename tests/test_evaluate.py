"""Rewards (verl's rules), the arithmetic and GSM8K data layouts, and `python -m fsdptrain.evaluate` against
generation and scoring done here without it."""

import json
import math
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdptrain.rl.data import load_prompts
from fsdptrain.rl.rewards import (
    RewardError,
    default_compute_score,
    extract_gsm8k_answer,
    gsm8k_score,
    last_boxed,
    load_reward_function,
    math_score,
    overlong_penalty,
    score_responses,
    score_sample,
)
from fsdptrain.rl.rollout.base import Generation, group_ids

from conftest import REPO


@pytest.mark.parametrize(
    "solution, strict, flexible",
    [
        ("So she has 5 + 3 = 8 apples.\n#### 8", "8", "8"),
        ("The total is 1,234 dollars.\n#### $1,234", None, "1234"),  # strict wants digits right after '#### '
        ("#### 1,234", "1234", "1234"),
        ("First 12, then #### 7, finally #### 9.", "9", "9"),
        ("It is -3.5 degrees.", None, "-3.5"),
        ("No number here.", None, None),
        ("#### 5" + "x" * 400, None, None),  # only the last 300 characters count
    ],
)
def test_gsm8k_answers_strict_and_flexible(solution, strict, flexible):
    assert extract_gsm8k_answer(solution, "strict") == strict
    assert extract_gsm8k_answer(solution, "flexible") == flexible


def test_gsm8k_and_math_scores():
    assert gsm8k_score("... #### 72", "72") == 1.0
    assert gsm8k_score("... #### 71", "72") == 0.0 and gsm8k_score("... #### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("72", "72") == 0.0  # no '####': strict finds no answer
    assert last_boxed(r"so \boxed{\frac{1}{2}} and finally \boxed{x^{2}+1}") == "x^{2}+1"
    assert last_boxed(r"\boxed{unclosed") is None
    assert math_score(r"The answer is $\boxed{\dfrac{1}{2}}$.", r"\frac{1}{2}") == 1.0
    assert math_score(r"\boxed{x = 3}", "3") == 1.0 and math_score(r"\boxed{3.0}", "3") == 1.0
    assert math_score(r"\boxed{4}", r"\boxed{3}") == 0.0 and math_score("3", "3") == 0.0
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("lighteval/MATH", r"\boxed{3}", "3") == 1.0
    # verl's geo3k rule (0.9 for the boxed answer, 0.1 for the <think> format)
    assert default_compute_score("hiyouga/geometry3k", r"<think>a, b</think> so \boxed{4}", "4") == 1.0
    assert default_compute_score("hiyouga/geometry3k", r"\boxed{4}", "4") == pytest.approx(0.9)
    assert default_compute_score("hiyouga/geometry3k", "<think>a\n</think>\n\\boxed{5}", "4") == pytest.approx(0.1)
    with pytest.raises(RewardError, match="no built-in reward for data_source 'poetry'"):
        default_compute_score("poetry", "x", "y")


def test_custom_reward_functions_load_and_fail_by_name(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {'score': len(solution_str), 'bonus': 1}\n"
        "def broken(data_source, solution_str, ground_truth, extra_info=None):\n    raise KeyError('label')\n"
        "def nan(*args):\n    return float('nan')\n"
    )
    fn = load_reward_function(str(path), None)
    assert score_sample(fn, "s", "abc", "x", None, "prompt 0") == {"score": 3.0, "bonus": 1.0, "acc": 1.0}
    assert load_reward_function(None, None) is default_compute_score
    with pytest.raises(RewardError, match=r"the reward function failed on prompt 4 \(s\), response 1: KeyError"):
        score_sample(load_reward_function(str(path), "broken"), "s", "abc", "x", None, "prompt 4 (s), response 1")
    with pytest.raises(RewardError, match="a finite score is required"):
        score_sample(load_reward_function(str(path), "nan"), "s", "abc", "x", None, "prompt 0")
    with pytest.raises(RewardError, match="custom_reward_function.name='missing'"):
        load_reward_function(str(path), "missing")
    with pytest.raises(RewardError, match="no such file"):
        load_reward_function(str(tmp_path / "nowhere.py"), None)


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    subprocess.run([sys.executable, "scripts/make_arithmetic_data.py", str(out), "--train", "60", "--val", "10", "--test", "12"],
                   cwd=REPO, check=True, capture_output=True)
    return out


def test_arithmetic_splits_share_no_question_and_their_answers_are_right(arithmetic, tokenizer):
    questions = {}
    for split in ("train", "val", "test"):
        rows = pq.read_table(arithmetic / f"rl_{split}.parquet").to_pylist()
        sft = pq.read_table(arithmetic / f"sft_{split}.parquet").column("messages").to_pylist()
        questions[split] = {r["prompt"][0]["content"] for r in rows}
        assert len(questions[split]) == len(rows)
        for row, messages in zip(rows, sft):
            a, name, b = row["prompt"][0]["content"].split("?")[0].split()[2:5]
            expected = {"plus": int(a) + int(b), "minus": int(a) - int(b), "times": int(a) * int(b)}[name]
            assert row["reward_model"]["ground_truth"] == str(expected) and row["data_source"] == "arithmetic"
            assert default_compute_score("arithmetic", messages[1]["content"], row["reward_model"]["ground_truth"]) == 1.0
    assert not (questions["train"] & questions["test"]) and not (questions["train"] & questions["val"])
    assert not (questions["val"] & questions["test"])
    prompts = load_prompts([str(arithmetic / "rl_test.parquet")], tokenizer)
    assert prompts[0].ids == tokenizer.apply_chat_template(prompts[0].messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"]


def test_a_system_message_replaces_the_templates_default(tmp_path, tokenizer):
    """With --system every chat, prompt and SFT transcript alike, starts with that message; an empty one renders
    in place of the chat template's default system prompt, so the prompts are shorter."""
    subprocess.run([sys.executable, "scripts/make_arithmetic_data.py", str(tmp_path), "--train", "8", "--val", "2", "--test", "3",
                    "--system", ""], cwd=REPO, check=True, capture_output=True)
    rows = pq.read_table(tmp_path / "rl_test.parquet").to_pylist()
    sft = pq.read_table(tmp_path / "sft_test.parquet").column("messages").to_pylist()
    for row, messages in zip(rows, sft):
        assert row["prompt"][0] == {"role": "system", "content": ""} and row["prompt"][1]["role"] == "user"
        assert messages[:2] == row["prompt"] and messages[2]["role"] == "assistant"
    with_default = tokenizer.apply_chat_template(rows[0]["prompt"][1:], add_generation_prompt=True, tokenize=False)
    rendered = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert len(rendered) < len(with_default) and rendered.endswith(with_default[with_default.index(rows[0]["prompt"][1]["content"]):])


def test_gsm8k_files_convert_to_both_layouts(tmp_path, tokenizer):
    source = tmp_path / "gsm_test.parquet"
    pq.write_table(pa.table({"question": ["Tom has 3 apples and buys 4. How many?"],
                             "answer": ["3 + 4 = <<3+4=7>>7\n#### 1,007"]}), source)
    subprocess.run([sys.executable, "scripts/make_arithmetic_data.py", str(tmp_path / "out"), "--from-gsm8k", str(source)],
                   cwd=REPO, check=True, capture_output=True)
    (prompt,) = load_prompts([str(tmp_path / "out" / "rl_gsm_test.parquet")], tokenizer)
    assert (prompt.data_source, prompt.ground_truth) == ("openai/gsm8k", "1007")
    sft = pq.read_table(tmp_path / "out" / "sft_gsm_test.parquet").column("messages").to_pylist()[0]
    assert sft[1]["content"].endswith("#### 1,007") and default_compute_score("openai/gsm8k", sft[1]["content"], "1007") == 1.0


def test_bad_rl_rows_are_named(tmp_path, tokenizer):
    from fsdptrain.data.dataset import DataError

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "arithmetic", "reward_model": {"ground_truth": "2", "style": "rule"}},
        {"prompt": [{"role": "user", "content": "2+2?"}], "data_source": "arithmetic", "reward_model": {"ground_truth": None, "style": "rule"}},
    ]), path)
    with pytest.raises(DataError, match=r"bad\.parquet row 1: no ground truth"):
        load_prompts([str(path)], tokenizer)
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "x"}]]}), tmp_path / "cols.parquet")
    with pytest.raises(DataError, match=r"missing column\(s\) \['data_source', 'reward_model \(or ground_truth\)'\]"):
        load_prompts([str(tmp_path / "cols.parquet")], tokenizer)


@pytest.mark.slow
def test_evaluate_equals_generation_and_scoring_done_here(tmp_path, tiny_llama, arithmetic):
    """The CLI's responses are those of plain greedy `generate` on each prompt alone (its batches are left-padded),
    scored by the user's function; accuracy and its standard error follow from the per-response records."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': float(len(solution_str) % 3), 'acc': float(len(solution_str) % 2)}\n")
    out, summary = tmp_path / "results.jsonl", tmp_path / "summary.json"
    data = str(arithmetic / "rl_test.parquet")
    result = subprocess.run([sys.executable, "-m", "fsdptrain.evaluate", tiny_llama, data, "--max-new-tokens", "6", "--batch-size", "5",
                             "--out", str(out), "--summary", str(summary), f"custom_reward_function.path={reward}"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    rows = pq.read_table(data).to_pylist()
    assert len(records) == len(rows)
    for row, record in zip(rows, records):
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        generated = model.generate(**ids, max_new_tokens=6, do_sample=False)[0, ids["input_ids"].shape[1]:]
        text = tokenizer.decode(generated, skip_special_tokens=True)
        assert record["response"] == text
        assert (record["score"], record["acc"]) == (len(text) % 3, len(text) % 2)
    accuracy = sum(r["acc"] for r in records) / len(records)
    figures = json.loads(summary.read_text())["arithmetic"]
    assert figures["acc"] == pytest.approx(accuracy) and figures["n"] == len(records)
    assert figures["acc_se"] == pytest.approx(math.sqrt(accuracy * (1 - accuracy) / len(records)))
    assert "arithmetic" in result.stdout and "± se" in result.stdout


@pytest.mark.parametrize("dtype", [None, "bf16", "fp32"])
def test_evaluate_computes_in_the_dtype_asked(tiny_llama, tokenizer, dtype):
    from fsdptrain.dtypes import compute_dtype
    from fsdptrain.evaluate import build_engine

    cpu = torch.device("cpu")
    engine = build_engine("hf", tiny_llama, tokenizer, 64, 0, cpu, compute_dtype(dtype, cpu))
    assert engine.model.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)


def test_responses_are_scored_against_their_own_prompt(arithmetic, tokenizer):
    """Response i answers prompt i // n: each is decoded and scored against that prompt's ground truth, and a
    failing reward function names the response."""
    prompts = load_prompts([str(arithmetic / "rl_test.parquet")], tokenizer)[:2]
    texts = [f"#### {prompts[0].ground_truth}", "#### nothing", "#### 0", f"#### {prompts[1].ground_truth}"]
    ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
    responses = [Generation(prompts[i // 2].ids, response, [1] * len(response), None, False) for i, response in enumerate(ids)]
    scored = score_responses(default_compute_score, tokenizer, prompts, responses, group_ids(len(prompts), 2), "")
    assert [s["response"] for s in scored] == texts  # special tokens dropped
    assert [s["response_length"] for s in scored] == [len(response) for response in ids]
    assert [s["acc"] for s in scored] == [1.0, 0.0, float(prompts[1].ground_truth == "0"), 1.0]
    with pytest.raises(RewardError, match=r"failed on batch 3, prompt 1 \(arithmetic\), response 0: ZeroDivisionError"):
        score_responses(lambda source, text, truth, extra: 1 / (text != texts[2]), tokenizer, prompts, responses, group_ids(len(prompts), 2), "batch 3, ")


def test_overlong_penalty_falls_linearly_over_the_buffer():
    # max 100 tokens, buffer 20: no penalty up to 80, -0.5 at 90, -1 at 100 (factor 1), -2 with factor 2
    assert [overlong_penalty(n, 100, 20, 1.0) for n in (50, 80, 90, 100)] == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(100, 100, 20, 2.0) == -2.0


def test_the_quickstart_report_pairs_the_problems(tmp_path):
    """GRPO - SFT over the same problems, matched by index whatever the order: the paired standard error."""
    from show_result import paired_difference

    sft, grpo = tmp_path / "sft.jsonl", tmp_path / "grpo.jsonl"
    sft.write_text("".join(json.dumps({"index": i, "acc": a}) + "\n" for i, a in enumerate([1, 0, 0, 0, 1])))
    grpo.write_text("".join(json.dumps({"index": i, "acc": a}) + "\n" for i, a in reversed(list(enumerate([1, 1, 1, 0, 0])))))
    gain, se = paired_difference(str(sft), str(grpo))
    # differences 0, 1, 1, 0, -1: mean 0.2, sample variance (0.04 + 0.64 * 2 + 0.04 + 1.44) / 4 = 0.7
    assert gain == pytest.approx(0.2) and se == pytest.approx(math.sqrt(0.7 / 5))
