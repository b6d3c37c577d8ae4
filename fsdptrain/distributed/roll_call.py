"""Which ranks are still there after a collective failed.

A transport error says only that a peer's connection closed (gloo gives its address, which on one host or behind
a NAT names no one) or that the wait timed out. So every rank beats: a thread of its own adds one to its counter
in the run's key-value store (the one the process group started from, at MASTER_ADDR:MASTER_PORT: under torchrun
node 0's agent holds it) every HEARTBEAT_S seconds, whatever the rank's main thread is doing (a long write, a
collective that waits). After a failure a rank reads every counter twice, STALE_S apart: a rank whose counter did
not move is gone (killed, crashed, its node lost) or stopped. The store goes with its host, so a failure to reach
it names node 0.
"""

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_S = 1.0
STALE_S = 4.0  # four beats: a thread a few beats late under load is not taken for lost


def run_store(timeout_s: float) -> dist.TCPStore:
    """A client of the run's key-value store (the one its process group started from)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _key(rank: int) -> str:
    return f"fsdptrain/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


_beating: tuple[threading.Thread, threading.Event] | None = None


def start_heartbeat(rank: int, world_size: int) -> None:
    """This rank's beat, in a thread of its own, until stop_heartbeat (nothing to beat for alone)."""
    global _beating
    if world_size == 1 or _beating is not None:
        return
    store = run_store(30.0)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                store.add(_key(rank), 1)
            except RuntimeError:  # the store is gone: whoever reads the beats will say so
                return
            stop.wait(HEARTBEAT_S)

    thread = threading.Thread(target=beat, name="fsdptrain-heartbeat", daemon=True)
    thread.start()
    _beating = (thread, stop)


def stop_heartbeat() -> None:
    """End the beat and wait for its thread, before the process group is destroyed: destroyed while the beat's
    store client lives, the process aborts at exit ("terminate called without an active exception") after a
    finished run."""
    global _beating
    if _beating is None:
        return
    thread, stop = _beating
    stop.set()
    thread.join(timeout=2 * HEARTBEAT_S)
    _beating = None


@dataclass(frozen=True)
class RollCall:
    alive: list[int] | None  # ranks whose beat moved, this one included; None: the store itself is gone
    world_size: int

    @property
    def missing(self) -> list[int]:
        return [] if self.alive is None else sorted(set(range(self.world_size)) - set(self.alive))

    @property
    def reporter(self) -> bool:
        """Whether this rank prints the outcome: the lowest one alive (every rank, when the store is gone)."""
        return self.alive is None or int(os.environ.get("RANK", 0)) == min(self.alive)

    def describe(self) -> str:
        if self.alive is None:
            return (f"the run's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} does not answer either: "
                    "node 0, which holds it, is gone (killed, crashed or unreachable)")
        if not self.missing:
            return "every rank is still beating: a transport failure, not a lost rank"
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        nodes = sorted({rank // per_node for rank in self.missing})
        where = f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} as torchrun numbers them)" if per_node < self.world_size else ""
        return (f"rank{'s' if len(self.missing) > 1 else ''} {', '.join(map(str, self.missing))}{where} stopped beating: gone (killed, "
                "crashed, its node lost) or stopped; that node's log says which")


def _reported_key() -> str:
    return f"fsdptrain/reported/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def announce_reported() -> None:
    """The reporter has printed the roll call's outcome: the other ranks may leave (torchrun stops every worker
    of a node as soon as one exits, so a rank that left first could cut the report off)."""
    try:
        run_store(STALE_S).set(_reported_key(), "1")
    except RuntimeError:  # the store is gone: every rank reports for itself
        pass


def await_report(timeout_s: float) -> None:
    """Wait, at most `timeout_s`, until the reporter has printed (announce_reported)."""
    try:
        store = run_store(timeout_s)
        store.wait([_reported_key()], timedelta(seconds=timeout_s))
    except RuntimeError:  # the store is gone, or the reporter never got there: leave anyway
        pass


def roll_call(stale_s: float = STALE_S) -> RollCall:
    """Which ranks' beats still move: read them all, wait `stale_s`, read them again."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        store = run_store(stale_s)
        keys = [_key(rank) for rank in range(world_size)]
        first = [store.add(key, 0) for key in keys]
        time.sleep(stale_s)
        second = [store.add(key, 0) for key in keys]
    except RuntimeError:  # torch.distributed's store errors are RuntimeErrors
        return RollCall(None, world_size)
    return RollCall([rank for rank in range(world_size) if second[rank] > first[rank]], world_size)
