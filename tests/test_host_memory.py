"""keep_freed_host_memory: a large tensor, once freed, stays mapped in the process for the next allocation instead
of going back to the kernel. Each case runs in a fresh interpreter, since the setting holds for the whole process."""

import subprocess
import sys

import pytest

SCRIPT = """
import sys, torch
from fsdptrain.trainer.runtime import keep_freed_host_memory
if sys.argv[1] == "keep":
    keep_freed_host_memory()
def anonymous_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
tensor = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page touched
before = anonymous_kb()
del tensor
print(before - anonymous_kb())
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc")
def test_freed_memory_stays_mapped():
    released_kb = {mode: int(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True).stdout)
                   for mode in ("default", "keep")}
    assert released_kb["default"] >= 60 * 1024  # glibc unmapped the tensor: its pages would fault in again
    assert released_kb["keep"] < 4 * 1024
