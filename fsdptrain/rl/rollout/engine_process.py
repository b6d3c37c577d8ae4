"""A rollout engine in a process of its own, for a standalone rollout rank (separate_async) whose engine builds
itself over the torch.distributed world of the process it runs in (vLLM's: EngineInfo.own_world). A rollout rank's
world is the whole job's, and the training ranks never join the groups such an engine would create there; so the
rank spawns a clean child (no process group), which builds the engine as a single process (EngineSpec.distributed
false, as evaluate.py does) and answers its calls over a pipe. Weights cross as shared-memory tensors, one at a
time, into the engine's own streaming load. The child ends when the pipe closes: with its rank, however that ends.

Partial rollouts: with a `refresh` (the rollout rank's: hf.WeightsRefresh), the rank looks for newer weights while
the child generates, and sends them; the child, between two engine steps, finds them waiting, stops its unfinished
requests, loads them, takes their version from the rank, and goes on (VLLMRollout.generate_reloading). Each reply
is tagged with the call it answers, since a generation may finish while the rank is sending weights.
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
from fsdptrain.rl.rollout.hf import WeightsRefresh
from fsdptrain.rl.rollout.remote import LOOK_EVERY_S

# torchrun's variables name the job's world; the child's engine is a world of one, whose own init must not read them
JOB_WORLD = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


class EngineFailed(RuntimeError):
    """The engine's process raised (its traceback in the message) or ended."""


class EngineProcess:
    """The engine `name` built from `spec` in a spawned process; its RolloutEngine calls are answered there. The
    engine is always awake (a rollout rank's has nothing else to make room for), so sleep and wake_up do nothing."""

    def __init__(self, name: str, spec: EngineSpec):
        context = torch.multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve_engine, args=(name, replace(spec, distributed=False, free_cache_engine=False), child),
                                       daemon=True, name="fsdptrain-rollout-engine")
        self.process.start()
        child.close()
        self.dtype, self.group = spec.dtype, None
        self.refresh: WeightsRefresh | None = None  # partial rollouts: newer weights taken while it generates
        self.replies: dict[str, Any] = {}  # replies read while waiting for another's
        self.reply("built")

    def reply(self, call: str) -> Any:
        while call not in self.replies:
            try:
                answered, failed, value = self.conn.recv()
            except EOFError:
                raise EngineFailed(f"the rollout engine's process (pid {self.process.pid}) ended, exit code {self.process.exitcode}") from None
            if failed:
                raise EngineFailed(f"in the rollout engine's process:\n{value}")
            self.replies[answered] = value
        return self.replies.pop(call)

    def generate(self, prompts: Sequence[list[int]], *, n: int, max_new_tokens: int, batch_size: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, do_sample: bool = True, calculate_log_probs: bool = False) -> list[Generation]:
        refresh = self.refresh
        sampling = dict(n=n, max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature, top_p=top_p, top_k=top_k,
                        do_sample=do_sample, calculate_log_probs=calculate_log_probs)
        self.conn.send(("generate", ([list(ids) for ids in prompts],), {**sampling, "version": refresh.version if refresh else None}))
        while refresh is not None and "generate" not in self.replies and not self.conn.poll(LOOK_EVERY_S):
            if (version := refresh.load()) is not None:  # sent by update_weights; the child waits for their version
                self.conn.send(("version", version))
        return self.reply("generate")

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.conn.send(("update_weights", (), {}))
        for name, tensor in weights:
            self.conn.send((name, tensor))
        self.conn.send(None)
        self.reply("update_weights")

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        self.conn.send(("shutdown", (), {}))
        self.reply("shutdown")
        self.conn.close()
        self.process.join()


class PipeReload:
    """In the engine's process, during a generation: the rank's newer weights, waiting in the pipe (vllm.Reload)."""

    def __init__(self, conn: multiprocessing.connection.Connection, engine: Any, version: int):
        self.conn, self.engine, self.version = conn, engine, version

    def pending(self) -> bool:
        return self.conn.poll()

    def load(self) -> None:
        call, _, _ = self.conn.recv()
        assert call == "update_weights", call  # the one call a rank makes while the child generates
        load_weights(self.engine, self.conn)
        self.conn.send(("update_weights", False, None))
        tag, self.version = self.conn.recv()
        assert tag == "version", tag


def load_weights(engine: Any, conn: multiprocessing.connection.Connection) -> None:
    """The weights the rank streams after an update_weights call, into the engine."""
    stream = received_weights(conn)
    try:
        engine.update_weights(stream)
    finally:
        for _ in stream:  # what a failed load left unread, so that the next call reads a call
            pass


def received_weights(conn: multiprocessing.connection.Connection) -> Iterator[tuple[str, torch.Tensor]]:
    while (item := conn.recv()) is not None:
        yield item


def serve_engine(name: str, spec: EngineSpec, conn: multiprocessing.connection.Connection) -> None:
    for variable in JOB_WORLD:
        os.environ.pop(variable, None)
    try:
        engine = build_rollout(name, spec)
    except Exception:
        conn.send(("built", True, traceback.format_exc()))
        return
    conn.send(("built", False, None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the rank is gone
            return
        call, args, kwargs = message if len(message) == 3 else (message[0], (), {})
        if call == "version":  # of weights that came after the generation they were meant for had finished
            continue
        try:
            if call == "update_weights":
                result = load_weights(engine, conn)
            elif call == "generate":
                version = kwargs.pop("version")
                engine.reload = PipeReload(conn, engine, version) if version is not None else None
                result = engine.generate(*args, **kwargs)
            else:
                result = getattr(engine, call)(*args, **kwargs)
        except Exception:
            conn.send((call, True, traceback.format_exc()))
            continue
        conn.send((call, False, result))
        if call == "shutdown":
            return
