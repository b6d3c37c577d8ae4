"""How a trainer process ends. A user's error (errors.UserError: a setting, a file, a row, a reward function, a server) or a lost rank
(errors.LostRankError) ends a trainer with its message printed once and no traceback, so that the last lines on
the screen say what to fix. Anything else is a bug and keeps its traceback.

Under torchrun rank 0 (for a lost rank: the lowest rank still there) prints the message; for a lost rank the
others leave once it has (torchrun stops a node's workers when one exits). Every failing rank writes
its error file, which torchrun's summary prints as the failure's traceback: there the message would be printed a
second time, so the file says where it was printed; only where torchrun redirects the worker's output to its own
log files (--redirects, --log-dir) does the file hold the message itself. Raised
before the process group starts, every rank has found the same problem: the other ranks leave first, so that the
summary lists rank 0's failure alone. Started any other way, each failing rank prints its message.
"""

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch.distributed as dist

from fsdptrain.distributed.launcher import under_torchrun
from fsdptrain.distributed.roll_call import announce_reported, await_report
from fsdptrain.errors import LostRankError, UserError

LEAVE_FIRST_S = 1.0  # how long rank 0 waits for the other ranks to exit before it fails


@contextmanager
def user_errors_reported() -> Iterator[None]:
    try:
        yield
    except (UserError, LostRankError) as e:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        reporter = e.reporter if isinstance(e, LostRankError) else rank == 0
        everyone = isinstance(e, UserError) and not (dist.is_available() and dist.is_initialized())
        if everyone and rank != 0:
            exit_without_teardown(0)  # rank 0 reports the problem every rank found
        message = f"fsdptrain: {e}" if everyone or world_size == 1 else f"fsdptrain (rank {rank}): {e}"
        if reporter or not under_torchrun():
            print(message, file=sys.stderr, flush=True)
        write_error_file(message)
        if isinstance(e, LostRankError) and reporter:
            announce_reported()
        elif isinstance(e, LostRankError):
            await_report(e.report_within_s)
        if everyone and world_size > 1:
            time.sleep(LEAVE_FIRST_S)
        exit_without_teardown(1)


def write_error_file(message: str) -> None:
    """torchrun's error file for this worker (TORCHELASTIC_ERROR_FILE), in torchelastic's format: the message
    itself where this worker's output goes to torchrun's log files, else where it was printed."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        if not output_redirected_beside(path):
            message = "the problem is printed above, on the line that starts with 'fsdptrain'"
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}, f)


def output_redirected_beside(error_file: str) -> bool:
    """Whether this worker's stderr is a file in its error file's folder: torchrun's log of it (--redirects)."""
    try:
        return os.path.dirname(os.path.realpath("/proc/self/fd/2")) == os.path.dirname(os.path.realpath(error_file))
    except OSError:
        return False


def exit_without_teardown(code: int) -> NoReturn:
    """End a trainer process whose work is done (a finished run, one that reported a user's error, or a launcher
    whose workers have ended) without the interpreter's teardown of torch's and transformers' modules, which is slow
    and does nothing such a process needs: a finished run has closed its files, destroyed its process group and
    shut its engine down, and a failed one has said why."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
