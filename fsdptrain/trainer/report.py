"""A user's error (errors.UserError: a setting, a file, a row, a reward function, a server) or a lost rank
(errors.LostRankError) ends a trainer with its message printed once and no traceback, so that the last lines on
the screen say what to fix. Anything else is a bug and keeps its traceback.

Under torchrun rank 0 (for a lost rank: the lowest rank still there) prints the message and every failing rank
writes it to its error file, which torchrun's summary prints as the failure's traceback: a problem found on
another rank alone still ends the output. Raised
before the process group starts, every rank has found the same problem: the other ranks leave first, so that the
summary lists rank 0's failure alone. Started any other way, each failing rank prints its message.
"""

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from fsdptrain.distributed.launcher import under_torchrun
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
            sys.exit(0)  # rank 0 reports the problem every rank found
        message = f"fsdptrain: {e}" if everyone or world_size == 1 else f"fsdptrain (rank {rank}): {e}"
        if reporter or not under_torchrun():
            print(message, file=sys.stderr, flush=True)
        write_error_file(message)
        if everyone and world_size > 1:
            time.sleep(LEAVE_FIRST_S)
        sys.exit(1)


def write_error_file(message: str) -> None:
    """torchrun's error file for this worker (TORCHELASTIC_ERROR_FILE), in torchelastic's format."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
