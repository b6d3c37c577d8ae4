"""FSDP2's collectives on CPU (gloo), without the full-size copies gloo's own make.

Reduce-scatter: gloo has none of its own: torch clones the whole input and all-reduces it, and FSDP2 first
copies each group's gradients into a freshly allocated input. On this project's CPU VM a fresh buffer of that
size costs its page faults (SmolLM2 over 2 ranks: 86 ms per decoder layer, of which 72 ms is those two copies).
This comm reuses one input buffer while consecutive groups have the same size (the decoder layers, one after
another) and reduces with an all-to-all, through which each rank receives only its own shard from every rank,
then sums.

All-gather: gloo's receives into a temporary buffer of the whole output, allocated in its worker thread, then
copies that into the output. Point-to-point sends and receives move each shard straight into its place.
"""

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule


class ReusedBufferReduceScatter:
    """A reduce-scatter comm for `FSDPModule.set_custom_reduce_scatter` (FSDP2's `ReduceScatter` interface:
    `allocate` for its input and output buffers, then the call; the base class is private, so it is duck-typed).

    Only the last input buffer, and the buffer it is received into, are kept, and only while the next group's
    input has the same size: nothing outlives the backward pass, so the step's peak memory is unchanged.
    FSDP views its output buffer as the sharded gradients. If it asks for an output of the kept size, it gets the
    kept buffer, but that call's input has another size (world size times), so the kept buffer is dropped there.
    """

    def __init__(self) -> None:
        self._last_input: Optional[tuple] = None  # (numel, dtype, device) of the previous call's input
        self._kept_input: Optional[torch.Tensor] = None
        self._kept_received: Optional[torch.Tensor] = None

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
        this_input = (input_tensor.numel(), input_tensor.dtype, input_tensor.device)
        if this_input != self._last_input:
            self._kept_input = self._kept_received = None
        elif self._kept_input is None:
            self._kept_input, self._kept_received = input_tensor, torch.empty_like(input_tensor)
        self._last_input = this_input
        received = self._kept_received if input_tensor is self._kept_input else torch.empty_like(input_tensor)

        dist.all_to_all_single(received, input_tensor, group=group)
        shards = received.view(group.size(), -1)
        torch.add(shards[0], shards[1], out=output_tensor)
        for shard in shards[2:]:
            output_tensor.add_(shard)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(group.size())


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
        rank, shards = group.rank(), output_tensor.view(group.size(), -1)
        if shards[rank].data_ptr() != input_tensor.data_ptr():
            shards[rank].copy_(input_tensor)
        operations = []
        for peer in range(group.size()):
            if peer != rank:
                peer_rank = dist.get_global_rank(group, peer)
                operations.append(dist.P2POp(dist.isend, input_tensor, peer_rank, group))
                operations.append(dist.P2POp(dist.irecv, shards[peer], peer_rank, group))
        for work in dist.batch_isend_irecv(operations):
            work.wait()


def use_gloo_comms(model: nn.Module) -> None:
    """Give every FSDP group of `model` the comms above, one shared instance of each (groups communicate one
    after another). A torch without FSDP2's custom comms keeps the defaults."""
    reduce_scatter, all_gather = ReusedBufferReduceScatter(), PointToPointAllGather()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        if hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(reduce_scatter)
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(all_gather)
