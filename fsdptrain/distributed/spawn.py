"""A trainer that starts its own workers, as verl's `python3 -m verl.trainer.main_ppo trainer.n_gpus_per_node=8`
does: `python -m fsdptrain.grpo_trainer trainer.n_gpus_per_node=N ...` (N > 1, one node, not under torchrun)
launches N workers on this machine with torch's elastic agent, the one torchrun runs, in this process (a process
that another launcher started, torchrun or one that sets WORLD_SIZE, trains itself). Unlike torchrun it prints no
summary of its own beyond one line: a worker that fails for a user's mistake has already printed the mistake
(trainer/report.py), so the last lines on the screen say what to fix. Several nodes are launched by torchrun on
each (docs/multinode.md).
"""

import logging
import os
import signal
import sys
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fsdptrain.config.verl_keys import rollout_shape
from fsdptrain.distributed.launcher import under_torchrun

SHAPE_KEYS = ("trainer.nnodes", "trainer.n_gpus_per_node")


def launch_shape(argv: list[str]) -> tuple[int, int] | None:
    """(nnodes, n_gpus_per_node) as the command line gives them, where it gives either as an integer."""
    given = {}
    for override in argv:
        key, _, value = override.partition("=")
        if key.lstrip("+") in SHAPE_KEYS:
            try:
                given[key.lstrip("+").rsplit(".", 1)[1]] = int(value)
            except ValueError:
                return None  # the config's loading names the value
    return (given.get("nnodes", 1), given.get("n_gpus_per_node", 1)) if given else None


def launch_workers_if_asked(module: str, argv: list[str]) -> int | None:
    """Run `module` with `argv` on the workers the command line asks for, and return the exit code for this
    process; None where this process is to train itself (under torchrun, or one process asked for)."""
    shape = launch_shape(argv)
    if under_torchrun() or "WORLD_SIZE" in os.environ or shape is None:  # already a launcher's worker
        return None
    nodes, per_node = shape
    rollout = rollout_shape(argv)  # separate_async's standalone rollout ranks come after the training ones
    rollout_nodes, rollout_per_node = rollout.get("nnodes", 0), rollout.get("n_gpus_per_node", per_node)
    rollout_ranks = rollout_nodes * rollout_per_node if isinstance(rollout_nodes, int) and isinstance(rollout_per_node, int) else 0
    if (nodes, per_node + rollout_ranks) == (1, 1):
        return None
    if nodes != 1:
        print(f"fsdptrain: trainer.nnodes={nodes}: several nodes are launched by torchrun on each, with "
              f"--nnodes={nodes} --nproc_per_node={per_node} (docs/multinode.md)", file=sys.stderr)
        return 1
    return launch_workers(module, argv, per_node + rollout_ranks)


def launch_workers(module: str, argv: list[str], processes: int) -> int:
    """`python -m module argv` on `processes` workers of this machine, as `torchrun --standalone` starts them;
    the exit code: 0, or 1 with one line naming the first failed worker."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the line below says it once
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn")
    try:
        elastic_launch(config, sys.executable)("-m", module, *argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
        print(f"fsdptrain: {module} stopped: rank {rank} {how}", file=sys.stderr)
        return 1
    except SignalException as e:  # the agent stopped the workers first
        print(f"fsdptrain: {module} stopped by {signal.Signals(e.sigval).name}", file=sys.stderr)
        return 128 + e.sigval
    return 0
