"""scripts/smoke_sft.sh passes on a healthy run and names the check that fails on a broken one."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def smoke(tmp_path, model, data, *overrides, nproc=2):
    env = {**os.environ, "MODEL": model, "TRAIN": data["train"], "VAL": data["val"], "OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
           "NPROC": str(nproc)}
    return subprocess.run(["bash", "scripts/smoke_sft.sh", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_smoke_passes(tmp_path, tiny_qwen2, chat_data):
    result = smoke(tmp_path, tiny_qwen2, chat_data)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SMOKE OK" in result.stdout


def test_smoke_names_the_failed_check(tmp_path, tiny_llama, chat_data):
    result = smoke(tmp_path, tiny_llama, chat_data, "trainer.total_training_steps=3", nproc=1)  # stops before the step-5 save
    assert result.returncode != 0
    assert "SMOKE FAILED: checkpoint: " in result.stderr and "global_step_5/huggingface is missing" in result.stderr


def test_grpo_smoke_passes(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["bash", "scripts/smoke_grpo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SMOKE OK" in result.stdout


def test_arithmetic_data_keeps_to_the_operations_asked(tmp_path):
    import pyarrow.parquet as pq

    script = [sys.executable, "scripts/make_arithmetic_data.py", str(tmp_path), "--train", "40", "--val", "4", "--test", "4"]
    subprocess.run([*script, "--operations", "plus,times"], cwd=REPO, check=True, capture_output=True)
    questions = [row[0]["content"] for row in pq.read_table(tmp_path / "rl_train.parquet").column("prompt").to_pylist()]
    operations = {next(name for name in ("plus", "minus", "times") if f" {name} " in q) for q in questions}
    assert operations == {"plus", "times"}
    failed = subprocess.run([*script, "--operations", "plus,divide"], cwd=REPO, capture_output=True, text=True)
    assert failed.returncode != 0 and "--operations: unknown ['divide']" in failed.stderr
