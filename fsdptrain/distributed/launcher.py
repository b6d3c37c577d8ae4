"""A worker lives no longer than its torchrun launcher.

torchrun starts each worker in a session of its own, so a launcher that dies without stopping its workers (the
out-of-memory killer, a scheduler ending the job, `kill -9`) leaves them training and writing checkpoints with
nothing watching them, and racing a restarted job for the same run directory. A worker therefore asks to be
killed with its launcher: the kernel's parent-death signal on Linux, else a thread that watches the parent's pid.
SIGKILL writes nothing further: a save in flight stays a temporary directory, which the next run removes.
"""

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # from linux/prctl.h


def under_torchrun() -> bool:
    """Whether torchrun's agent started this process (it sets TORCHELASTIC_RUN_ID for its workers)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_launcher(poll_seconds: float = 1.0) -> None:
    """Be killed when the parent process (torchrun's agent) dies. A process started any other way (a plain
    `python -m`, under nohup) is left alone: its parent's death is no reason to stop."""
    if not under_torchrun():
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the launcher died before the signal was asked for
            os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fsdptrain-launcher-watch", daemon=True).start()


def fault_point(point: str, step: int) -> None:
    """A worker's deliberate death, with which the restart tests show that a run survives a lost worker at any
    point of a step: FSDPTRAIN_KILL_AT=POINT@STEP[:RANK] SIGKILLs rank RANK (default the last) when it reaches
    `point` at `step`, in torchrun's first attempt only, so that the restarted workers pass; a comma-separated list
    kills once in each attempt, its k-th entry in attempt k. The points: each timed phase of a step as it starts
    (trainer/setup.py's StepTimer: gen, update_actor, update_weights, ...; SFT's update), `save` (a checkpoint's
    shards written, not yet published) and `rollout` (a standalone rollout rank about to generate the batch of
    step STEP, rl/rollout/remote.py)."""
    specs = os.environ.get("FSDPTRAIN_KILL_AT", "").split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(specs) or not specs[attempt]:
        return
    where, _, rank = specs[attempt].partition(":")
    name, _, at = where.partition("@")
    target = int(rank) if rank else int(os.environ.get("WORLD_SIZE", "1")) - 1
    if name == point and int(at) == step and int(os.environ.get("RANK", "0")) == target:
        os.kill(os.getpid(), signal.SIGKILL)
