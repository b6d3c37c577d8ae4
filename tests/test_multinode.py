"""Two nodes on one machine: two torchrun launchers, 2 processes each, meeting at a c10d rendezvous on the loopback
address, the model sharded within a node and replicated across the two (fsdp_size=2), as docs/multinode.md
launches a real cluster. One node killed mid-run; the survivor ends naming the lost ranks; both relaunched
resume and finish with the numbers of a run never interrupted. And the bytes each rank's collectives move in
such a run, counted from its profile, against scripts/scaling_model.py."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import scaling_model
from safetensors import safe_open

from fsdptrain.distributed.roll_call import STALE_S

from conftest import REPO, assert_same_run, free_port, latest_checkpoint, read_metrics, run_sft, sft_args, torchrun, wait_for_checkpoint, workers

pytestmark = pytest.mark.slow

STEPS = 6
TIMEOUT_S = 10
RUN = dict(trainer__total_training_steps=STEPS, trainer__save_freq=2, trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model]",
           model__fsdp_config__fsdp_size=2, trainer__nccl_timeout=TIMEOUT_S, data__micro_batch_size_per_gpu=1)


def start_node(port: int, args: list[str], log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=loopback", "-m", "fsdptrain.sft_trainer", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_two_nodes(args: list[str], logs: list) -> list[subprocess.Popen]:
    """The first launcher hosts the rendezvous; the second joins once it listens."""
    port = free_port()
    first = start_node(port, args, logs[0])
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert first.poll() is None and time.monotonic() < deadline, "the first launcher never listened"
            time.sleep(0.1)
    return [first, start_node(port, args, logs[1])]


def node_ranks(launcher: subprocess.Popen) -> tuple[int, list[int]]:
    """The node number torchrun gave a launcher and its workers' global ranks, read from their environments."""
    environments = []
    for pid in workers(launcher.pid):
        with open(f"/proc/{pid}/environ") as f:
            environments.append(dict(item.split("=", 1) for item in f.read().split("\0") if "=" in item))
    assert len(environments) == 2, environments
    return int(environments[0]["GROUP_RANK"]), sorted(int(env["RANK"]) for env in environments)


def test_a_lost_node_is_named_and_the_relaunched_nodes_resume_exactly(tmp_path, tiny_llama, chat_data):
    reference = str(tmp_path / "reference")
    run_sft(4, tiny_llama, chat_data, reference, **RUN)  # one launcher, 4 processes, the same 2 x 2 layout

    out = str(tmp_path / "run")
    args = sft_args(tiny_llama, chat_data, out, **RUN)
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
    nodes = start_two_nodes(args, logs)
    try:
        wait_for_checkpoint(out, 2, nodes[0])
        numbered = {node_ranks(launcher)[0]: launcher for launcher in nodes}
        lost_ranks = node_ranks(numbered[1])[1]
        os.killpg(numbered[1].pid, signal.SIGKILL)  # node 1: its launcher and workers (node 0 holds the store)
        killed = time.monotonic()
        assert numbered[0].wait(timeout=TIMEOUT_S + 30) != 0
        # the survivors learn of the loss from a closed connection at once, or from the collective's timeout where
        # their pending operation waits on a rank that is alive and stuck too; then the roll call
        assert time.monotonic() - killed < TIMEOUT_S + 2 * STALE_S + 10
    finally:
        for launcher in nodes:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    survivor = logs[nodes.index(numbered[0])]
    survivor.seek(0)
    output = survivor.read()
    named = f"ranks {', '.join(map(str, lost_ranks))} (node 1 as torchrun numbers them) stopped beating"
    assert named in output and "(trainer.nccl_timeout)" in output, output[-4000:]  # printed, and in torchrun's summary
    assert 2 <= latest_checkpoint(out) < STEPS

    logs = [open(tmp_path / f"relaunch{i}.log", "w+") for i in range(2)]
    nodes = start_two_nodes(args, logs)
    for launcher, log in zip(nodes, logs):
        if launcher.wait(timeout=600) != 0:
            log.seek(0)
            raise AssertionError(log.read()[-5000:])
    assert [m["step"] for m in read_metrics(out)] == list(range(1, STEPS + 1))
    assert_same_run(out, reference, atol=1e-6)


def collective_bytes(trace_path: str) -> tuple[dict[str, float], list[int], int]:
    """What a rank's profiled step moved, by FSDP2 collective, as scaling_model counts it (bytes through the rank),
    and the micro-batches (forward passes) of the step. On CPU each shard group's all-gather and reduce-scatter
    are point-to-point sends (trainer.cpu_speedups.point_to_point_collectives): a rank sends exactly the ring's
    (W - 1) / W of the tensor. The replicas' gradient all-reduce is gloo's ring: 2 (R - 1) / R of the shard."""
    events = [e for e in json.load(open(trace_path))["traceEvents"] if e.get("ph") == "X"]
    phases = [e for e in events if e["name"].startswith("FSDP::")]

    def phase(event: dict) -> str:
        # by its start alone: gloo records an asynchronous collective on its worker thread, started inside the phase
        # (on the main thread) that issued it, perhaps ending after it
        enclosing = [p for p in phases if p["ts"] <= event["ts"] <= p["ts"] + p["dur"]]
        return min(enclosing, key=lambda p: p["dur"])["name"] if enclosing else ""

    def size(event: dict) -> int:
        return math.prod(event["args"]["Input Dims"][0]) * {"float": 4, "c10::BFloat16": 2, "double": 8}[event["args"]["Input type"][0]]

    moved = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0}
    all_reduces = []
    for event in events:
        if event["name"] == "gloo:send" and phase(event).startswith("FSDP::all_gather"):
            moved["all-gather"] += size(event)
        elif event["name"] == "gloo:send" and phase(event).startswith("FSDP::post_backward_reduce"):
            moved["reduce-scatter"] += size(event)
        elif event["name"] == "gloo:all_reduce" and phase(event).startswith("FSDP::post_backward_reduce"):
            all_reduces.append(size(event))
    return moved, all_reduces, sum(e["name"] == "FSDP::root_pre_forward" for e in events)


@pytest.mark.parametrize("fsdp_size", [2, -1], ids=["hsdp-two-nodes", "fsdp-one-node"])
def test_the_scaling_model_counts_the_bytes_a_run_moves(tmp_path, tiny_llama, chat_data, fsdp_size):
    out = str(tmp_path / "run")
    args = dict(trainer__total_training_steps=2, trainer__profile_step=2, model__fsdp_config__fsdp_size=fsdp_size, data__val_files="null")
    if fsdp_size == 2:
        logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
        for launcher, log in zip(start_two_nodes(sft_args(tiny_llama, chat_data, out, **args), logs), logs):
            if launcher.wait(timeout=600) != 0:
                log.seek(0)
                raise AssertionError(log.read()[-5000:])
    else:
        run_sft(4, tiny_llama, chat_data, out, **args)
    with safe_open(os.path.join(tiny_llama, "model.safetensors"), "pt") as weights:
        params = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    shard = 4 if fsdp_size == -1 else fsdp_size
    for rank in range(4):
        counted, all_reduces, micro_batches = collective_bytes(os.path.join(out, "profile", f"step2_rank{rank}.json"))
        counted["all-reduce"] = 2 * (4 // shard - 1) / (4 // shard) * sum(all_reduces)
        assert micro_batches >= 1 and (fsdp_size == -1) == (not all_reduces)
        predicted = scaling_model.collectives(params, shard, 4 // shard, micro_batches, param_bytes=4, grad_bytes=4)
        assert counted == pytest.approx(predicted, rel=1e-12), (rank, counted, predicted)


@pytest.mark.parametrize("attempt", range(3))  # each catches a missing stop about half the time
def test_a_beating_rank_exits_cleanly_after_end_run(attempt):
    """The heartbeat's store client alive when the process group goes aborts the process at exit ("terminate
    called without an active exception"), which a finished 4-process run once did: end_run stops the beat first."""
    result = torchrun(4, "tests.checks.heartbeat_exit_check", [], check=False)
    assert result.returncode == 0 and "terminate called" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("left False") == 4


def test_every_group_of_a_mesh_waits_the_runs_timeout():
    """A rank stuck in a mesh group's collective (a lost node's peer) gives up after trainer.nccl_timeout, so that
    the roll call above names the lost ranks in time; a group built with torch's default would wait 30 minutes."""
    result = torchrun(4, "tests.checks.mesh_timeout_check", [], check=False)
    assert result.returncode == 0 and result.stdout.count("ok") == 4, (result.stdout + result.stderr)[-3000:]

