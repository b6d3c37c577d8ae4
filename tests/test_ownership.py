"""A run owns its processes and its directory, tested with real processes under the real torchrun launcher:
workers die with a killed launcher and write nothing after; a second run on a live directory is refused naming
the holder, and a dead run's directory is taken over; a stuck rank fails the run within the collective timeout,
naming the step; and torchrun's restarts after a worker killed at any point of a step (mid-step, mid-save,
mid-rollout, mid-weight-sync; SFT, GRPO with HF and vLLM rollouts) give every step's metrics of an uninterrupted
run."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from compare_metrics import differences
from conftest import (
    REPO,
    free_port,
    latest_checkpoint,
    launch,
    read_metrics,
    run_sft,
    sft_args,
    torchrun,
    wait_for,
    wait_for_checkpoint,
    workers,
)
from test_grpo import grpo_args

pytestmark = pytest.mark.slow

LOCK = ".fsdptrain.lock"
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # docs/sft.md: restarted workers must not read stale addresses


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def leftovers(out: str) -> list[str]:
    return [name for name in os.listdir(out) if name.endswith(".tmp") or name == LOCK]


def test_workers_die_with_their_launcher_and_write_nothing_after(tmp_path, tiny_llama, chat_data):
    out = str(tmp_path / "run")
    process = launch(2, "fsdptrain.sft_trainer", sft_args(tiny_llama, chat_data, out, trainer__total_training_steps=200, trainer__save_freq=1,
                                                          data__val_files="null"), str(tmp_path / "log"))
    wait_for_checkpoint(out, 2, process)
    pids = workers(process.pid)
    assert len(pids) == 2
    os.kill(process.pid, signal.SIGKILL)  # the launcher alone, as an out-of-memory killer would
    process.wait()
    at_kill, deadline = latest_checkpoint(out), time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids), "workers outlived their launcher by 10 s"
    steps = len(read_metrics(out))
    time.sleep(2)
    assert latest_checkpoint(out) == at_kill and len(read_metrics(out)) == steps, "a worker went on writing after its launcher died"


def test_one_writer_per_directory_and_a_dead_runs_directory_is_taken_over(tmp_path, tiny_llama, chat_data):
    out = str(tmp_path / "run")
    first = launch(2, "fsdptrain.sft_trainer", sft_args(tiny_llama, chat_data, out, trainer__total_training_steps=200, trainer__save_freq=1,
                                                        data__val_files="null"), str(tmp_path / "first.log"))
    wait_for_checkpoint(out, 1, first)
    holder = json.loads(open(os.path.join(out, LOCK)).read())
    second = torchrun(1, "fsdptrain.sft_trainer", sft_args(tiny_llama, chat_data, out, trainer__total_training_steps=3), check=False)
    assert second.returncode != 0
    assert f"trainer.default_local_dir={out} is in use by another run" in second.stderr
    assert f'"pid": {holder["pid"]}' in second.stderr and holder["host"] in second.stderr
    assert latest_checkpoint(out) >= 1 and first.poll() is None, "the refused run touched the live one"
    # The first run dies whole (launcher and workers) in the middle of a save; its lock file and half-written
    # save stay behind, and the next run takes the directory over and resumes.
    wait_for(os.path.join(out, f".global_step_{latest_checkpoint(out) + 2}.tmp"), first)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    time.sleep(1)
    assert os.path.exists(os.path.join(out, LOCK))
    resumed_from = latest_checkpoint(out)
    run_sft(2, tiny_llama, chat_data, out, trainer__total_training_steps=resumed_from + 1, data__val_files="null")
    assert latest_checkpoint(out) == resumed_from + 1 and not leftovers(out)


def test_a_stuck_rank_fails_the_run_within_the_timeout_naming_the_step(tmp_path, tiny_llama, chat_data):
    """Rank 1 stops (SIGSTOP: alive, so nothing notices) after step 1; rank 0's next collective gives up after
    trainer.nccl_timeout and the run fails naming the step, the collective, the key and the rank that
    stopped beating, without a traceback."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "fsdptrain.sft_trainer", *sft_args(tiny_llama, chat_data, out, trainer__total_training_steps=50,
                                                                 trainer__nccl_timeout=5, data__val_files="null")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    logs = [open(tmp_path / f"rank{rank}.log", "w+") for rank in range(2)]
    ranks = [subprocess.Popen(cmd, cwd=REPO, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT)
             for rank, log in enumerate(logs)]
    try:
        metrics = os.path.join(out, "metrics.jsonl")
        wait_for(metrics, ranks[0])
        ranks[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        ranks[0].wait(timeout=60)
        assert ranks[0].returncode != 0
        assert time.monotonic() - stopped < 30
        logs[0].seek(0)
        output = logs[0].read()
        assert "fsdptrain (rank 0): step " in output and "rank 1 stopped beating" in output, output[-3000:]
        assert "Collectives wait 5 s for every rank (trainer.nccl_timeout)" in output and "Traceback" not in output, output[-3000:]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def restarted_run(tmp_path, module: str, args: list[str], kills: list[str]) -> str:
    """`module` under torchrun with the last rank killed at kills[k] (POINT@STEP) in attempt k, and as many
    restarts; returns the run's directory once it has finished. Each attempt resumes from the last complete
    checkpoint, so that a kill is reached again after the ones before it when its step is past that checkpoint."""
    out = str(tmp_path / "restarted")
    log = str(tmp_path / "restarted.log")
    process = launch(2, module, [*args, f"trainer.default_local_dir={out}"], log, [f"--max-restarts={len(kills)}"],
                     {**RESTARTABLE, "FSDPTRAIN_KILL_AT": ",".join(kills)})
    assert process.wait(timeout=600) == 0, open(log).read()[-5000:]
    assert open(log).read().count("exitcode: -9") == len(kills), open(log).read()[-5000:]  # torchrun's own account of each lost worker
    return out


def assert_same_steps(out: str, reference: str) -> None:
    """Every step's metrics (timings aside) as the uninterrupted run's, the last checkpoint complete, nothing
    half-written and no lock left."""
    found = differences({m["step"]: m for m in read_metrics(out)}, {m["step"]: m for m in read_metrics(reference)}, rtol=1e-6, atol=1e-9)
    assert not found, found
    last = read_metrics(reference)[-1]["step"]
    assert latest_checkpoint(out) == last and os.path.isfile(os.path.join(out, f"global_step_{last}", "meta.json"))
    assert not leftovers(out), leftovers(out)


SFT_RUN = dict(trainer__total_training_steps=4, trainer__save_freq=1, optim__lr_warmup_steps_ratio=0.25)


@pytest.fixture(scope="module")
def sft_straight(tmp_path_factory, tiny_llama, chat_data):
    out = str(tmp_path_factory.mktemp("sft_straight"))
    run_sft(2, tiny_llama, chat_data, out, **SFT_RUN)
    return out


def test_sft_restarts_after_lost_workers_and_trains_the_same(tmp_path, tiny_llama, chat_data, sft_straight):
    """Killed mid-save, then (resumed from the step before) mid-step."""
    args = [a for a in sft_args(tiny_llama, chat_data, "unused", **SFT_RUN) if not a.startswith("trainer.default_local_dir=")]
    assert_same_steps(restarted_run(tmp_path, "fsdptrain.sft_trainer", args, ["save@2", "update@3"]), sft_straight)


GRPO_RUN = dict(trainer__total_training_steps=3, trainer__save_freq=1, actor_rollout_ref__actor__ppo_mini_batch_size=2,
                actor_rollout_ref__actor__use_kl_loss="true", trainer__test_freq=2)


def grpo_run_args(model: str, data, **overrides) -> list[str]:
    args = grpo_args(model, data, "unused", **GRPO_RUN, **overrides)
    return [a for a in args if not a.startswith("trainer.default_local_dir=")]


@pytest.fixture(scope="module")
def grpo_straight(tmp_path_factory, tiny_llama, rl_data):
    out = str(tmp_path_factory.mktemp("grpo_straight"))
    torchrun(2, "fsdptrain.grpo_trainer", [*grpo_run_args(tiny_llama, rl_data), f"trainer.default_local_dir={out}"])
    return out


def test_grpo_restarts_after_lost_workers_and_trains_the_same(tmp_path, tiny_llama, rl_data, grpo_straight):
    """Killed mid-rollout and mid-save of step 2, and mid-step 3, one after the other. (A kill as the weight sync
    begins leaves what a kill as the rollout begins does, step 2's update unsaved; vLLM's sync is killed below.)"""
    kills = ["gen@2", "save@2", "update_actor@3"]
    assert_same_steps(restarted_run(tmp_path, "fsdptrain.grpo_trainer", grpo_run_args(tiny_llama, rl_data), kills), grpo_straight)


VLLM = dict(actor_rollout_ref__rollout__name="vllm", actor_rollout_ref__rollout__gpu_memory_utilization=0.1,
            actor_rollout_ref__rollout__tensor_model_parallel_size=2)
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.fixture(scope="module")
def vllm_straight(tmp_path_factory, vllm_llama, rl_data):
    out = str(tmp_path_factory.mktemp("vllm_straight"))
    torchrun(2, "fsdptrain.grpo_trainer", [*grpo_run_args(vllm_llama, rl_data, **VLLM), f"trainer.default_local_dir={out}"])
    return out


@needs_vllm
def test_vllm_grpo_restarts_after_lost_workers_and_trains_the_same(tmp_path, vllm_llama, rl_data, vllm_straight):
    """Killed as step 2's weight sync into vLLM begins (the engine split over both ranks, its shared-memory segments
    left behind): the restarted engines take the same weights and the run the same numbers. A rank killed mid-rollout is the hf engine's test above, and, on
    vLLM, separate_async's rollout rank (test_async.py)."""
    kills = ["update_weights@2"]
    assert_same_steps(restarted_run(tmp_path, "fsdptrain.grpo_trainer", grpo_run_args(vllm_llama, rl_data, **VLLM), kills), vllm_straight)
