"""Which ranks are still there after a collective failed.

A transport error says only that a peer's connection closed (gloo gives its address, which on one host or behind
a NAT names no one) or that the wait timed out. The ranks that reach this point answer a roll call in the run's
key-value store (the one the process group started from, at MASTER_ADDR:MASTER_PORT: under torchrun its node 0's
agent holds it) and wait a while for the others; a rank that never answers is gone (killed, crashed, its node
lost) or stuck. The store goes with its host, so a roll call that cannot reach it names node 0.
"""

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

ROLL_CALL_S = 10.0  # survivors reach their failure within a second or two of each other: peers' errors cascade


@dataclass(frozen=True)
class RollCall:
    answered: list[int] | None  # ranks that answered, this one included; None: the store itself is gone
    world_size: int

    @property
    def missing(self) -> list[int]:
        return [] if self.answered is None else sorted(set(range(self.world_size)) - set(self.answered))

    @property
    def reporter(self) -> bool:
        """Whether this rank is the one that prints the outcome: the lowest that answered (every rank, when none
        could answer)."""
        return self.answered is None or int(os.environ.get("RANK", 0)) == min(self.answered)

    def describe(self) -> str:
        if self.answered is None:
            return (f"the run's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} does not answer either: "
                    "node 0, which holds it, is gone (killed, crashed or unreachable)")
        if not self.missing:
            return "every rank answered a roll call afterwards: a transport failure, not a lost rank"
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        nodes = sorted({rank // per_node for rank in self.missing})
        where = f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} as torchrun numbers them)" if per_node < self.world_size else ""
        return (f"rank{'s' if len(self.missing) > 1 else ''} {', '.join(map(str, self.missing))}{where} did not answer a roll call within "
                f"{ROLL_CALL_S:g} s: gone (killed, crashed, its node lost) or stuck; that node's log says which")


def roll_call(window_s: float = ROLL_CALL_S) -> RollCall:
    """Answer, then wait up to `window_s` for every rank to answer. Each rank that reaches a failure calls it once."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    prefix = f"fsdptrain/roll_call/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=window_s), wait_for_workers=False)
        store.set(f"{prefix}{rank}", "here")
        answers = store.add(f"{prefix}count", 1)
        deadline = time.monotonic() + window_s
        while answers < world_size and time.monotonic() < deadline:
            time.sleep(0.1)
            answers = store.add(f"{prefix}count", 0)
        return RollCall([r for r in range(world_size) if store.check([f"{prefix}{r}"])], world_size)
    except RuntimeError:  # torch.distributed's store errors are RuntimeErrors
        return RollCall(None, world_size)
