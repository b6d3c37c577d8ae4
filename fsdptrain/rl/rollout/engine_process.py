"""A rollout engine in a process of its own, for a standalone rollout rank (separate_async) whose engine builds
itself over the torch.distributed world of the process it runs in (vLLM's: EngineInfo.own_world). A rollout rank's
world is the whole job's, and the training ranks never join the groups such an engine would create there; so the
rank spawns a clean child (no process group), which builds the engine as a single process (EngineSpec.distributed
false, as evaluate.py does) and answers its calls over a pipe. Weights cross as shared-memory tensors, one at a
time, into the engine's own streaming load. The child ends when the pipe closes: with its rank, however that ends.
"""

import multiprocessing.connection
import os
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.multiprocessing

from fsdptrain.rl.rollout import build_rollout
from fsdptrain.rl.rollout.base import EngineSpec, Generation

# torchrun's variables name the job's world; the child's engine is a world of one, whose own init must not read them
JOB_WORLD = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


class EngineFailed(RuntimeError):
    """The engine's process raised (its traceback in the message) or ended."""


class EngineProcess:
    """The engine `name` built from `spec` in a spawned process; its RolloutEngine calls are answered there."""

    def __init__(self, name: str, spec: EngineSpec):
        context = torch.multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve_engine, args=(name, replace(spec, distributed=False), child), daemon=True,
                                       name="fsdptrain-rollout-engine")
        self.process.start()
        child.close()
        self.dtype, self.group = spec.dtype, None
        self.result()  # built, or its error raised here

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.conn.send((method, args, kwargs))
        return self.result()

    def result(self) -> Any:
        try:
            failed, value = self.conn.recv()
        except EOFError:
            raise EngineFailed(f"the rollout engine's process (pid {self.process.pid}) ended, exit code {self.process.exitcode}") from None
        if failed:
            raise EngineFailed(f"in the rollout engine's process:\n{value}")
        return value

    def generate(self, prompts: Sequence[list[int]], **sampling: Any) -> list[Generation]:
        return self.call("generate", [list(ids) for ids in prompts], **sampling)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.conn.send(("update_weights", (), {}))
        for name, tensor in weights:
            self.conn.send((name, tensor))
        self.conn.send(None)
        self.result()

    def sleep(self) -> None:
        self.call("sleep")

    def wake_up(self) -> None:
        self.call("wake_up")

    def shutdown(self) -> None:
        self.call("shutdown")
        self.conn.close()
        self.process.join()


def received_weights(conn: multiprocessing.connection.Connection) -> Iterator[tuple[str, torch.Tensor]]:
    while (item := conn.recv()) is not None:
        yield item


def serve_engine(name: str, spec: EngineSpec, conn: multiprocessing.connection.Connection) -> None:
    for variable in JOB_WORLD:
        os.environ.pop(variable, None)
    try:
        engine = build_rollout(name, spec)
    except Exception:
        conn.send((True, traceback.format_exc()))
        return
    conn.send((False, None))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:  # the rank is gone
            return
        try:
            if method == "update_weights":
                stream = received_weights(conn)
                try:
                    result = engine.update_weights(stream)
                finally:
                    for _ in stream:  # what a failed load left unread, so that the next call reads a call
                        pass
            else:
                result = getattr(engine, method)(*args, **kwargs)
        except Exception:
            conn.send((True, traceback.format_exc()))
            continue
        conn.send((False, result))
        if method == "shutdown":
            return

