"""One writer per run directory (trainer.default_local_dir): a run holds an exclusive lock on a file in it from
its start to its end. The operating system releases the lock when the holder dies, however it dies, so a crash
leaves no stale lock; a second run on a live directory fails at once, naming the holder.

Taking the lock, a run also removes the temporary directories of saves that a dead run left half-written: with
the lock held, no other writer can own them.
"""

import datetime
import fcntl
import json
import os
import shutil
import socket

from fsdptrain.checkpoint.manager import TRACKER
from fsdptrain.errors import ConfigError

LOCK_FILE = ".fsdptrain.lock"
_held: dict[str, int] = {}  # directory -> the open lock file, kept open for the life of the process


def lock_run_directory(directory: str, key: str = "trainer.default_local_dir") -> None:
    """Hold `directory`'s lock for the rest of this process, or raise naming the holder and `key`."""
    directory = os.path.abspath(directory)
    if directory in _held:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not written its name yet"
            os.close(fd)
            raise ConfigError(f"{key}={directory} is in use by another run ({holder}); let it finish or stop it, or set {key} to "
                              "another directory") from None
        # A run that ended cleanly removes the file after taking it: the lock counts only on the file now there.
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": datetime.datetime.now().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    _held[directory] = fd
    remove_unfinished_saves(directory)


def remove_unfinished_saves(directory: str) -> None:
    """The temporary directories and files of saves that never completed (their run died mid-save)."""
    for name in os.listdir(directory):
        if name.startswith((".global_step_", ".best_step_")) and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        elif name in (TRACKER + ".tmp", ".best.tmp"):
            os.remove(os.path.join(directory, name))


def release_run_directory(directory: str) -> None:
    """Remove the lock file, then give the lock up, at the end of a run that ended cleanly (a crashed run's file
    stays, and the next run takes it over)."""
    directory = os.path.abspath(directory)
    fd = _held.pop(directory, None)
    if fd is not None:
        os.remove(os.path.join(directory, LOCK_FILE))
        os.close(fd)
