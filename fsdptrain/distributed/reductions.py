"""Sums and maxima over ranks of host-side numbers (losses, token counts, memory), in float64, and lists joined
over ranks."""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdptrain.distributed.mesh import Parallel


def all_reduce_sum(values: Sequence[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def dp_all_reduce_sum(value: float, parallel: Parallel) -> float:
    """Sum over data-parallel ranks (each SP group counted once)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=parallel.device)
    dist.all_reduce(tensor, group=parallel.mesh.get_group("dp"))
    return float(tensor)


def max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def once_per_sp_group(counts: Sequence[float], parallel: Parallel) -> list[float]:
    """Counts of samples every SP rank holds whole, kept on one rank of the group so that a world sum counts
    them once (losses are summed over sequence slices and need no such care)."""
    return [c if parallel.sp_rank == 0 else 0 for c in counts]


def gather_lists(items: list[Any], parallel: Parallel) -> list[Any]:
    """Every rank's `items` (picklable), concatenated in rank order, on every rank."""
    parts = [None] * parallel.world_size
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]
