"""The run directory's lock on its own (the runs that use it: test_ownership.py): held by one process at a time,
the refusal naming the holder, released by a clean end or by the holder's death, and a dead run's half-written
saves removed by the next holder."""

import json
import os
import subprocess
import sys

import pytest

from fsdptrain.checkpoint import run_lock
from fsdptrain.errors import ConfigError


def lock_in_another_process(directory: str) -> subprocess.CompletedProcess:
    code = f"from fsdptrain.checkpoint.run_lock import lock_run_directory; lock_run_directory({directory!r}); print('held')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_a_held_directory_is_refused_naming_its_holder(tmp_path):
    directory = str(tmp_path / "run")
    run_lock.lock_run_directory(directory)
    try:
        holder = json.loads(open(os.path.join(directory, run_lock.LOCK_FILE)).read())
        assert holder["pid"] == os.getpid()
        refused = lock_in_another_process(directory)
        assert refused.returncode != 0
        assert f"trainer.default_local_dir={directory} is in use by another run" in refused.stderr
        assert f'"pid": {os.getpid()}' in refused.stderr
    finally:
        run_lock.release_run_directory(directory)
    assert not os.path.exists(os.path.join(directory, run_lock.LOCK_FILE))
    assert lock_in_another_process(directory).stdout.strip() == "held"  # released: the next run takes it


def test_a_dead_holders_lock_and_unfinished_saves_are_taken_over(tmp_path):
    directory = tmp_path / "run"
    assert lock_in_another_process(str(directory)).returncode == 0  # held, then its process ended without releasing it
    assert (directory / run_lock.LOCK_FILE).exists()
    (directory / ".global_step_4.tmp" / "model").mkdir(parents=True)
    (directory / "latest_checkpointed_iteration.txt.tmp").write_text("4")
    (directory / "global_step_2").mkdir()
    (directory / "notes.tmp").write_text("the user's")
    run_lock.lock_run_directory(str(directory))
    try:
        assert sorted(os.listdir(directory)) == [run_lock.LOCK_FILE, "global_step_2", "notes.tmp"]
    finally:
        run_lock.release_run_directory(str(directory))


def test_the_refusal_is_a_config_error(tmp_path, monkeypatch):
    directory = str(tmp_path / "run")
    held = subprocess.Popen([sys.executable, "-c", f"from fsdptrain.checkpoint.run_lock import lock_run_directory; "
                             f"lock_run_directory({directory!r}); print('held', flush=True); input()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="is in use by another run"):
            run_lock.lock_run_directory(directory)
    finally:
        held.kill()
        held.wait()
    run_lock.lock_run_directory(directory)  # its holder died: the lock is free
    run_lock.release_run_directory(directory)
