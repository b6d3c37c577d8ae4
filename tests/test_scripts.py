"""The smoke scripts pass on a healthy trainer and name the check that fails on one that does not learn; the arithmetic data's operations."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


BROKEN_STEP = """import torch
torch.optim.AdamW.step = lambda self, closure=None: None  # the optimizer step does nothing: a trainer that does not learn
"""


def smoke(script: str, out, broken: bool = False, model: str | None = None) -> subprocess.CompletedProcess:
    """A smoke script on its defaults (a tiny model and tokenizer made on the spot, or `model`); `broken`: with
    every process's optimizer step made a no-op (a sitecustomize module on PYTHONPATH)."""
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1", **({"MODEL": model} if model else {})}
    if broken:
        (out / "sitecustomize.py").write_text(BROKEN_STEP)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(out), os.environ.get("PYTHONPATH")]))
    return subprocess.run(["bash", f"scripts/{script}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("script, check", [("smoke_sft.sh", "loss falls"), ("smoke_grpo.sh", "score rises")])
def test_smoke_passes_on_its_defaults_and_fails_on_a_trainer_that_does_not_learn(tmp_path, script, check):
    result = smoke(script, tmp_path / "healthy")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SMOKE OK" in result.stdout
    # the broken trainer on the tiny model the healthy run made
    result = smoke(script, tmp_path / "broken", broken=True, model=str(tmp_path / "healthy" / "tiny_model"))
    assert result.returncode != 0
    assert f"SMOKE FAILED: {check}: " in result.stderr, result.stderr[-3000:]


def test_arithmetic_data_keeps_to_the_operations_asked(tmp_path):
    import pyarrow.parquet as pq

    script = [sys.executable, "scripts/make_arithmetic_data.py", str(tmp_path), "--train", "40", "--val", "4", "--test", "4"]
    subprocess.run([*script, "--operations", "plus,times"], cwd=REPO, check=True, capture_output=True)
    questions = [row[0]["content"] for row in pq.read_table(tmp_path / "rl_train.parquet").column("prompt").to_pylist()]
    operations = {next(name for name in ("plus", "minus", "times") if f" {name} " in q) for q in questions}
    assert operations == {"plus", "times"}
    failed = subprocess.run([*script, "--operations", "plus,divide"], cwd=REPO, capture_output=True, text=True)
    assert failed.returncode != 0 and "--operations: unknown ['divide']" in failed.stderr


def test_short_answers_ask_the_same_problems_and_answer_only_after_the_mark(tmp_path):
    import pyarrow.parquet as pq

    def split(answer: str) -> list[list[dict]]:
        out = tmp_path / answer
        subprocess.run([sys.executable, "scripts/make_arithmetic_data.py", str(out), "--train", "60", "--val", "4", "--test", "4",
                        "--answer", answer], cwd=REPO, check=True, capture_output=True)
        return pq.read_table(out / "sft_train.parquet").column("messages").to_pylist()

    worked, short = split("worked"), split("short")
    assert [chat[:-1] for chat in worked] == [chat[:-1] for chat in short]  # the same draw of problems
    for worked_chat, short_chat in zip(worked, short):
        question, answer = short_chat[-2]["content"], short_chat[-1]["content"]
        a, name, b = question.removeprefix("What is ").split("?")[0].split()
        expected = {"plus": int(a) + int(b), "minus": int(a) - int(b), "times": int(a) * int(b)}[name]
        assert answer == f"#### {expected}" and worked_chat[-1]["content"].endswith(answer)


def test_no_instruction_asks_the_same_questions_without_it(tmp_path):
    """--no-instruction: every prompt, the reworded split's too, is its question alone, the same draw otherwise."""
    import pyarrow.parquet as pq

    def prompts(*flags: str) -> list[str]:
        out = tmp_path / ("bare" if flags else "instructed")
        subprocess.run([sys.executable, "scripts/make_arithmetic_data.py", str(out), "--train", "20", "--val", "4", "--test", "4",
                        "--reworded", "30", *flags], cwd=REPO, check=True, capture_output=True)
        return [row[-1]["content"] for split in ("train", "reworded") for row in pq.read_table(out / f"rl_{split}.parquet").column("prompt").to_pylist()]

    instructed, bare = prompts(), prompts("--no-instruction")
    assert all("####" in prompt for prompt in instructed) and not any("####" in prompt for prompt in bare)
    assert all(full.startswith(question + " ") for full, question in zip(instructed, bare))


def test_reworded_split_asks_held_out_problems_in_other_words(tmp_path):
    import pyarrow.parquet as pq

    subprocess.run([sys.executable, "scripts/make_arithmetic_data.py", str(tmp_path), "--train", "300", "--val", "50", "--test", "50",
                    "--reworded", "200"], cwd=REPO, check=True, capture_output=True)

    def problems(split: str) -> list[tuple[str, str]]:
        rows = pq.read_table(tmp_path / f"rl_{split}.parquet").to_pylist()
        return [(row["prompt"][-1]["content"], row["reward_model"]["ground_truth"]) for row in rows]

    def problem(prompt: str) -> tuple[str, int, int]:
        """(operation, a, b) of a prompt in any of the wordings, read independently of the script's templates."""
        question = re.split(r"[?.] ", prompt)[0]
        a, b = map(int, re.findall(r"\d+", question))
        if re.match(r"Subtract|How much is \d+ added to", question):
            a, b = b, a
        words = {"+": ("Add", "sum", "+", "added", "plus"), "-": ("Subtract", "difference", "-", "take away", "minus"),
                 "*": ("Multiply", "product", "*", "multiplied", "times")}
        return next(op for op, said in words.items() if any(w in question for w in said)), a, b

    trained, reworded = problems("train"), problems("reworded")
    assert len(reworded) == 200 and all("####" in prompt for prompt, _ in reworded)
    # no reworded prompt uses the training prompts' question or instruction, and there are many phrasings
    question_words = {re.sub(r"\d+", "N", prompt.split("?")[0]) for prompt, _ in trained}
    instruction = trained[0][0].split("? ", 1)[1]
    assert all(re.sub(r"\d+", "N", prompt.split("?")[0]) not in question_words and instruction not in prompt for prompt, _ in reworded)
    assert len({re.sub(r"\d+", "N", prompt) for prompt, _ in reworded}) > 20
    for prompt, truth in reworded:  # each answer is its problem's
        op, a, b = problem(prompt)
        assert int(truth) == {"+": a + b, "-": a - b, "*": a * b}[op], prompt
    held_out = {problem(prompt) for prompt, _ in reworded}
    for split in ("train", "val", "test"):  # no problem is in two splits
        assert not held_out & {problem(prompt) for prompt, _ in problems(split)}


@pytest.mark.parametrize("variable", ["TEST_ROWS", "REWORDED_ROWS"])
def test_quickstart_refuses_an_empty_held_out_set_before_training(tmp_path, variable):
    result = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "WORK": str(tmp_path), variable: "0"})
    assert result.returncode != 0 and f"quickstart: {variable} must be a positive number of problems, got '0'" in result.stderr
    assert not (tmp_path / "sft").exists() and not (tmp_path / "data").exists()


def test_the_vision_task_trains_sft_then_grpo_and_reports_the_paired_gain(tmp_path):
    """scripts/vision_task.sh end to end at toy sizes: data, model, SFT, GRPO with images, both evaluated."""
    sizes = {"WORK": str(tmp_path), "SFT_STEPS": "2", "GRPO_STEPS": "1", "GRPO_PROMPTS": "4", "TEST_ROWS": "8", "LAYERS": "1", "WIDTH": "64"}
    result = subprocess.run(["bash", "scripts/vision_task.sh"], cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **sizes})
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"GRPO - SFT on the same images: [+-]\d\.\d{3} ± \d\.\d{3}", result.stdout), result.stdout[-2000:]
    for name in ("sft", "grpo"):
        assert len((tmp_path / "eval" / f"{name}.jsonl").read_text().splitlines()) == 8
