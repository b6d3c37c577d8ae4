"""What the benchmarks share: launching a system in its own process tree and following that tree's memory."""

import os
import subprocess
import sys
import threading
import time


def _tree(root: int) -> list:
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(pid))
        except OSError:
            continue
    tree, todo = [], [root]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def _status_kb(pid: int) -> dict:
    """One process's memory counters in kB from /proc/<pid>/status, which the kernel keeps as counters: reading it
    costs microseconds. (smaps_rollup, which PSS needs, walks the page tables under the process's mmap lock: 35 ms
    for a 3 GB process here; sampled ten times a second it slowed the measured runs by 17-18%.)"""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmHWM", "RssAnon", "RssFile", "RssShmem")))
    return {key: int(value.split()[0]) for key, value in fields.items()}


def peak_tree_memory(process: subprocess.Popen, stop: threading.Event, out: dict) -> None:
    """Until `stop`, follow `process` and its descendants: out["rss"] is the sum of each process's peak RSS (the
    kernel's exact high-water mark; an upper bound on the peak of the sum), out["max_rss"] the largest of them,
    out["shared_once"] the sampled peak of the tree's memory with shared files counted once: the summed anonymous
    and shared-memory RSS plus the largest file-backed RSS (the torch libraries every process maps) (bytes)."""
    hwm, out["shared_once"] = {}, 0
    while not stop.is_set():
        private, files = 0, 0
        for pid in _tree(process.pid):
            try:
                kb = _status_kb(pid)
                hwm[pid] = kb["VmHWM"]
            except (OSError, KeyError):
                continue
            private += kb["RssAnon"] + kb["RssShmem"]
            files = max(files, kb["RssFile"])
        out["rss"], out["max_rss"] = sum(hwm.values()) * 1024, max(hwm.values()) * 1024
        out["shared_once"] = max(out["shared_once"], (private + files) * 1024)
        time.sleep(0.1)


def torchrun(nproc: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def launch(cmd, env=None) -> dict:
    """Run `cmd`; returns its process tree's summed peak RSS, peak memory with shared files counted once and largest
    process's peak RSS, in GB."""
    process = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stop, memory = threading.Event(), {}
    poller = threading.Thread(target=peak_tree_memory, args=(process, stop, memory))
    poller.start()
    _, err = process.communicate()
    stop.set()
    poller.join()
    if process.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed:\n{err[-4000:]}")
    return {"rss_gb": memory["rss"] / 2**30, "shared_once_gb": memory["shared_once"] / 2**30, "max_proc_rss_gb": memory["max_rss"] / 2**30}


def checkpoint_mb(run_dir: str) -> float:
    """Megabytes of the sharded model and optimizer state of a run's last checkpoint (what a resume reads)."""
    steps = sorted((d for d in os.listdir(run_dir) if d.startswith("global_step_")), key=lambda d: int(d.rsplit("_", 1)[1]))
    total = 0
    for part in ("model", "optimizer"):
        folder = os.path.join(run_dir, steps[-1], part)
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return total / 2**20
