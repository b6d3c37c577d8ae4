"""FSDP2's collectives on CPU (gloo) as point-to-point exchanges, without the full-size copies gloo's own make.

Reduce-scatter: gloo has none of its own: torch clones the whole input and all-reduces it, and FSDP2 first
copies each group's gradients into a freshly allocated input. On this project's CPU VM a fresh buffer of that
size costs its page faults (SmolLM2 over 2 ranks: 86 ms per decoder layer, of which 72 ms is those two copies).
Here each rank sends every peer that peer's shard of its input and receives its own shard from every peer,
then sums: only the (world size - 1) shards received are allocated, and the input buffer is reused while
consecutive groups have the same size (the decoder layers, one after another).

All-gather: gloo's receives into a temporary buffer of the whole output, allocated in its worker thread, then
copies that into the output. Here each rank sends its shard and receives every other shard straight into its
place.
"""

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule


def exchange(group: dist.ProcessGroup, to_send: Callable[[int], Sequence[torch.Tensor]],
             receive_into: Callable[[int], Sequence[torch.Tensor]]) -> None:
    """Send the tensors `to_send(peer)` to every other rank of `group` and receive from it into the tensors
    `receive_into(peer)`, in order, all posted at once (peers are group ranks)."""
    operations = []
    for peer in range(group.size()):
        if peer != group.rank():
            peer_rank = dist.get_global_rank(group, peer)
            operations += [dist.P2POp(dist.isend, t, peer_rank, group) for t in to_send(peer)]
            operations += [dist.P2POp(dist.irecv, t, peer_rank, group) for t in receive_into(peer)]
    for work in dist.batch_isend_irecv(operations) if operations else []:
        work.wait()


class PointToPointReduceScatter:
    """A reduce-scatter comm for `FSDPModule.set_custom_reduce_scatter` (FSDP2's `ReduceScatter` interface:
    `allocate` for its input and output buffers, then the call; the base class is private, so it is duck-typed).

    Only the last input buffer, and the buffer its shards are received into, are kept, and only while the next
    group's input has the same size: nothing outlives the backward pass, so the step's peak memory is unchanged.
    FSDP views its output buffer as the sharded gradients. If it asks for an output of the kept size, it gets the
    kept buffer, but that call's input has another size (world size times), so the kept buffer is dropped there.
    """

    def __init__(self) -> None:
        self._last_input: tuple | None = None  # (numel, dtype, device) of the previous call's input
        self._kept_input: torch.Tensor | None = None
        self._kept_received: torch.Tensor | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kept = self._kept_input
        if kept is not None and (kept.numel(), kept.dtype, kept.device) == (math.prod(size), dtype, torch.device(device)):
            return kept
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"reduce-scatter over gloo supports SUM and AVG, not {op}")
        rank, size = group.rank(), group.size()
        this_input = (input_tensor.numel(), input_tensor.dtype, input_tensor.device)
        same_size, self._last_input = this_input == self._last_input, this_input
        if not same_size:
            self._kept_input = self._kept_received = None
        if input_tensor is self._kept_input:
            received = self._kept_received
        else:
            received = input_tensor.new_empty(size - 1, input_tensor.numel() // size)
            if same_size and self._kept_input is None:  # the second group of a run of one size: keep from here on
                self._kept_input, self._kept_received = input_tensor, received

        shards = input_tensor.view(size, -1)
        # `received` holds the peers' shards in group-rank order, without this rank's.
        exchange(group, to_send=lambda peer: [shards[peer]], receive_into=lambda peer: [received[peer - (peer > rank)]])
        torch.add(shards[rank], received[0], out=output_tensor)
        for shard in received[1:]:
            output_tensor.add_(shard)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(size)


class PointToPointAllGather:
    """An all-gather comm for `FSDPModule.set_custom_all_gather` (FSDP2's `AllGather` interface, duck-typed like
    the reduce-scatter above). FSDP2 has already copied this rank's shard into its slot of the output, so the
    input is sent as it is and every other rank's shard is received into its own slot."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        shards = output_tensor.view(group.size(), -1)
        if shards[group.rank()].data_ptr() != input_tensor.data_ptr():
            shards[group.rank()].copy_(input_tensor)
        exchange(group, to_send=lambda peer: [input_tensor], receive_into=lambda peer: [shards[peer]])


def use_gloo_comms(model: nn.Module, shard_ranks: int) -> str | None:
    """Give every FSDP group of `model` the comms above, one shared instance of each (groups communicate one
    after another). Returns why they were not given (one rank has nothing to exchange; a torch without FSDP2's
    custom comms), or None."""
    if shard_ranks == 1:
        return "one rank has nothing to exchange"
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not groups or not hasattr(groups[0], "set_custom_reduce_scatter") or not hasattr(groups[0], "set_custom_all_gather"):
        return f"torch {torch.__version__} has no FSDP2 custom collectives (set_custom_reduce_scatter/all_gather)"
    reduce_scatter, all_gather = PointToPointReduceScatter(), PointToPointAllGather()
    for module in groups:
        module.set_custom_reduce_scatter(reduce_scatter)
        module.set_custom_all_gather(all_gather)
    return None
