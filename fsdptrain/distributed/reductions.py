"""Sums and maxima over ranks of host-side numbers (losses, token counts, memory), in float64, and lists joined
over ranks."""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdptrain.distributed.mesh import Parallel


def all_reduce_sum(values: Sequence[float], device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """Sums over the ranks of `group` (default: every rank)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def max_over_ranks(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor)


def once_per_sp_group(counts: Sequence[float], parallel: Parallel) -> list[float]:
    """Counts of samples every SP rank holds whole, kept on one rank of the group so that a world sum counts
    them once (losses are summed over sequence slices and need no such care)."""
    return [c if parallel.sp_rank == 0 else 0 for c in counts]


def gather_lists(items: list[Any], group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `items` (picklable) of `group` (default: every rank), concatenated in rank order, on each of them."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, items, group=group)
    return [item for part in parts for item in part]
