"""The benchmark scripts run (at toy sizes; their numbers are recorded in docs/performance.md, not asserted)."""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

from bench_sft import median_run
from conftest import REPO

pytestmark = pytest.mark.slow


def test_bench_logprob_runs_and_chunking_keeps_the_loss(tmp_path):
    out = tmp_path / "logprob.json"
    subprocess.run([sys.executable, "scripts/bench_logprob.py", "--tokens", "64", "--hidden", "32", "--chunk", "16", "--vocabs", "qwen2-151k",
                    "--json", str(out)], cwd=REPO, check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())
    assert [(r["vocab"], r["method"], r["chunk"]) for r in rows] == [("qwen2-151k", "full", 0), ("qwen2-151k", "fused", 16), ("qwen2-151k", "per-token", 16)]
    full = rows[0]
    for chunked in rows[1:]:
        assert abs(full["loss"] - chunked["loss"]) < 1e-3 * abs(full["loss"])


def test_bench_sp_runs(tmp_path):
    out = tmp_path / "sp.json"
    subprocess.run([sys.executable, "scripts/bench_sp.py", "--seq-len", "256", "--sizes", "1", "2", "--layers", "1", "--hidden", "64",
                    "--vocab", "512", "--iters", "1", "--json", str(out)], cwd=REPO, check=True, capture_output=True, timeout=300)
    results = json.loads(out.read_text())["results"]
    assert [r["tokens_per_rank"] for r in results] == [256, 128]
    assert results[1]["activation_mb"] < results[0]["activation_mb"]


def test_bench_sft_runs_fsdptrain_and_measures_its_processes(tmp_path):
    out = tmp_path / "sft.json"
    subprocess.run([sys.executable, "scripts/bench_sft.py", "--systems", "fsdptrain", "--steps", "2", "--batch", "4", "--micro", "2",
                    "--work", str(tmp_path), "--json", str(out)], cwd=REPO, check=True, capture_output=True, timeout=300)
    [row] = json.loads(out.read_text())["rows"]
    assert len(row["losses"]) == 2 and row["loss_tokens_per_s"] > 0
    assert row["loss_tokens_per_s_every_run"] == [row["loss_tokens_per_s"]]
    # Two ranks and the launcher each hold torch (hundreds of MB); "shared once" counts their shared libraries once.
    assert 0.5 < row["shared_once_gb"] < row["rss_gb"]
    assert 0.2 < row["max_proc_rss_gb"] < row["rss_gb"]  # one rank, not the sum


def test_repeated_runs_report_the_slower_middle_run_and_the_largest_peaks():
    runs = [{"step_times": [3.0, 3.0], "rss_gb": 1.0, "max_proc_rss_gb": 0.5}, {"step_times": [1.0, 1.0], "rss_gb": 2.0, "max_proc_rss_gb": 0.4},
            {"step_times": [2.0, 2.5], "rss_gb": 1.5, "max_proc_rss_gb": 0.7}, {"step_times": [2.0, 2.0], "rss_gb": 1.2, "max_proc_rss_gb": 0.6}]
    median = median_run(runs)
    assert median["step_times"] == [2.0, 2.5]  # of four runs (2, 4, 4.5, 6 s), the slower of the middle two
    assert median["rss_gb"] == 2.0 and median["max_proc_rss_gb"] == 0.7 and median["cuda_peak_gb"] is None
    assert median["run_seconds"] == [6.0, 2.0, 4.5, 4.0]


REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str.count("e") / max(len(solution_str), 1)
"""


def test_bench_grpo_runs_fsdptrain_and_trl_with_the_same_first_loss(tmp_path, tiny_llama):
    """A tiny Llama given an end-of-sequence output row (its embedding row is the zero padding row), so that
    responses end at different lengths: with equal lengths -sum A L / sum L is 0 whatever the advantages."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 3 * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data, reward, out = tmp_path / "data", tmp_path / "reward.py", tmp_path / "grpo.json"
    subprocess.run([sys.executable, "scripts/make_arithmetic_data.py", str(data), "--train", "16", "--val", "2", "--test", "2"], cwd=REPO, check=True,
                   capture_output=True)
    reward.write_text(REWARD)
    subprocess.run([sys.executable, "scripts/bench_grpo.py", "--model", str(tmp_path / "model"), "--data", str(data), "--reward", str(reward), "--steps", "2",
                    "--responses", "4", "--max-new-tokens", "8", "--systems", "fsdptrain-hf,trl-hf", "--work", str(tmp_path),
                    "--json", str(out)], cwd=REPO, check=True, capture_output=True, timeout=600)
    results = json.loads(out.read_text())["results"]
    for system in ("fsdptrain-hf", "trl-hf"):
        r = results[system]
        assert len(r["steps"]) == 2 and all(s["step"] > 0 for s in r["steps"]), (system, r)
        # At ratio 1 both losses are -sum A_i L_i / sum L_i of the system's own samples (rewards vary: not 0).
        assert abs(r["first_loss_expected"]) > 1e-3 and r["first_loss"] == pytest.approx(r["first_loss_expected"], rel=1e-4), system
        assert 0.2 < r["max_proc_rss_gb"] < 8


def test_bench_reward_server_loads_the_server_and_reports_latency(tmp_path):
    out = tmp_path / "server.json"
    subprocess.run([sys.executable, "scripts/bench_reward_server.py", "--clients", "1", "4", "--requests", "16", "--texts", "3", "--json", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["clients"] for r in rows] == [1, 4] and all(r["requests"] == 16 and r["p99_ms"] >= r["p50_ms"] > 0 for r in rows)


@pytest.mark.parametrize("beams", [False, True], ids=["sampling", "beams"])
def test_bench_rollout_times_both_systems_on_the_same_prompts(tmp_path, tiny_llama, beams):
    """Both systems time the same prompts; with --beams, constrained to a catalog of numbers, they find the same
    beams."""
    data, out = tmp_path / "data", tmp_path / "rollout.json"
    subprocess.run([sys.executable, "scripts/make_arithmetic_data.py", str(data), "--train", "16", "--val", "2", "--test", "2"], cwd=REPO, check=True,
                   capture_output=True)
    catalog = tmp_path / "items.txt"
    catalog.write_text("\n".join(str(k) for k in range(0, 400, 7)) + "\n")
    extra = ["--beams", "--catalog", str(catalog)] if beams else []
    subprocess.run([sys.executable, "scripts/bench_rollout.py", tiny_llama, str(data / "rl_train.parquet"), "--prompts", "3", "--n", "2",
                    "--max-new-tokens", "4", "--dtype", "fp32", "--repeats", "2", "--json", str(out), *extra], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"fsdptrain HF engine", "transformers generate"}
    for r in results.values():
        assert len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"]) and all(0 < length <= 4 for length in r["mean_length"])
    assert report.get("same_beams") == ([True] * 3 if beams else None)


def test_bench_matmul_runs_both_settings():
    result = subprocess.run([sys.executable, "scripts/bench_matmul.py", "--size", "64", "--seconds", "0.05"], cwd=REPO, check=True,
                            capture_output=True, text=True, timeout=300)
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["as", "AVX2"] and rows[1][1] == "AVX2"
    assert all(float(value) > 0 for row in rows for value in row[-3:])


def test_bench_update_times_each_phase_held_to_avx2(tiny_llama):
    result = subprocess.run([sys.executable, "scripts/bench_update.py", str(tiny_llama), "--tokens", "48", "--repeats", "1", "--avx2"],
                            cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    assert "torch CPU capability AVX2" in result.stdout
    assert "decoder forward" in result.stdout and "backward" in result.stdout


def test_bench_async_runs_both_modes_on_long_tailed_prompts(tmp_path, tiny_llama):
    """The sync mode, separate_async and colocate_async on the same processes, every other prompt asking for a long count."""
    out = tmp_path / "async.json"
    subprocess.run([sys.executable, "scripts/bench_async.py", "--model", tiny_llama, "--steps", "2", "--prompts", "2", "--responses", "2",
                    "--max-new-tokens", "8", "--long-every", "2", "--work", str(tmp_path), "--json", str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"sync", "separate_async", "colocate_async"}
    assert results["sync"]["lag_max"] == 0 and results["separate_async"]["lag_max"] <= 1 and results["colocate_async"]["lag_max"] <= 1
    assert all(r["samples_per_s"] > 0 and r["lengths"]["max"] <= 8 for r in results.values())
    prompts = pq.read_table(tmp_path / "data" / "long_tailed.parquet").column("prompt").to_pylist()
    assert sum("Count from 1 to 1000" in p[-1]["content"] for p in prompts) == len(prompts) // 2
