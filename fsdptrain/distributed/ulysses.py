"""Ulysses sequence parallelism: each rank of an SP group holds a contiguous slice of a packed row.

Attention needs every position, so around it q/k/v go from sequence-sharded to head-sharded (all-to-all),
attention runs over the full row for H/S heads, and the output goes back. Everything else in the model is
per-token and runs on the local slice; rotary embeddings see the slice's own (global) position ids.
"""


import torch
import torch.distributed as dist


def shard_sequence(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's slice of every (1, T) tensor; T must be a multiple of `size`."""
    chunk = next(iter(batch.values())).shape[1] // size
    return {k: v[:, rank * chunk : (rank + 1) * chunk] for k, v in batch.items()}


class _AllToAll(torch.autograd.Function):
    """All-to-all of equal slots along dim 0. Slot i goes to rank i; the backward sends every slot back,
    which is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous like x: the collective writes the buffer in row-major order
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(T/S, H, D) sequence slice -> (T, H/S, D): the whole sequence for this rank's heads."""
    size = dist.get_world_size(group)
    local, heads, dim = x.shape
    slots = x.reshape(local, size, heads // size, dim).transpose(0, 1)  # slot r: heads for rank r
    return _AllToAll.apply(slots, group).reshape(local * size, heads // size, dim)  # slot r: sequence slice r


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(T, H/S, D) -> (T/S, H, D): the inverse of seq_to_heads."""
    size = dist.get_world_size(group)
    total, heads, dim = x.shape
    slots = x.reshape(size, total // size, heads, dim)  # slot r: sequence slice r
    return _AllToAll.apply(slots, group).transpose(0, 1).reshape(total // size, heads * size, dim)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate the slices of a (1, T/S) tensor along the sequence (no gradient needed)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)
