"""The key=value arguments a verl 0.9 example script hands to verl's trainer, as bash computes them (arrays,
defaults, conditionals): the script runs with `python3`, `python` and `torchrun` replaced by a stand-in that
records the trainer's arguments and starts nothing; a device probe (`python3 -c 'import torch_npu'`) fails, as on a
GPU machine without NPUs."""

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

STAND_IN = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
if "-c" in args:
    sys.exit(1)
if "-m" in args and args[args.index("-m") + 1].startswith("verl.trainer."):
    with open(os.environ["VERL_ARGS_OUT"], "a") as f:
        f.write(json.dumps(args[args.index("-m") + 1:]) + "\\n")
"""


def launch_arguments(script: Path, *positional: str, env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """(verl's trainer module, its key=value arguments) of the script's one launch."""
    with tempfile.TemporaryDirectory() as bin_dir:
        for name in ("python3", "python", "torchrun", "ray", "hf", "git"):
            path = Path(bin_dir) / name
            path.write_text(STAND_IN)
            path.chmod(path.stat().st_mode | stat.S_IXUSR)
        out = Path(bin_dir) / "args.jsonl"
        environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VERL_ARGS_OUT": str(out), "HOME": bin_dir, **(env or {})}
        result = subprocess.run(["bash", str(script.resolve()), *positional], env=environment, capture_output=True, text=True, timeout=60, cwd=bin_dir)
        launches = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        if len(launches) != 1:
            raise AssertionError(f"{script.name}: {len(launches)} trainer launches (exit {result.returncode}): {result.stderr[-2000:]}")
    module, *args = launches[0]
    return module, [a for a in args if "=" in a and not a.startswith("-")]
