"""How the tests start a run's ranks (conftest.torchrun): each rank is forked from one process that imported the
trainers and transformers' model code once per session (multiprocessing's forkserver), then runs its module as
`python -m MODULE ARGS` would run it: as __main__, with that command line, in the repository, with its own
environment (torchrun's variables for its rank) and its output in its own files. The processes, the process group
and the code are the real ones; what is saved is each rank's interpreter start and imports, seconds a launch.

The server starts with the environment every launch sets (one OpenMP thread a process, which the OpenMP runtime
reads when torch is imported), so that the forked ranks run as the ranks of a fresh `python -m` did."""

import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[1]
LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
PRELOAD = ["forked_ranks", "fsdptrain.trainer.grpo", "fsdptrain.trainer.sft", "fsdptrain.config.verl_keys", "fsdptrain.config.help",
           "fsdptrain.distributed.spawn", "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           *(["vllm"] if importlib.util.find_spec("vllm") else [])]
_context = None


def run_as_main(module: str, args: list[str], env: dict[str, str], stdout_path: str, stderr_path: str) -> NoReturn:
    """In the forked rank: `python -m module args` with `env`, its output to the two files; exits with its code."""
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    os.environ.update(env)
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver, started once with LAUNCH_ENV and the trainers imported."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        saved = {key: os.environ.get(key) for key in LAUNCH_ENV}
        os.environ.update(LAUNCH_ENV)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
    return _context


def start_rank(module: str, args: list[str], env: dict[str, str], stdout_path: str, stderr_path: str) -> multiprocessing.Process:
    process = context().Process(target=run_as_main, args=(module, args, env, stdout_path, stderr_path), daemon=False)
    process.start()
    return process
