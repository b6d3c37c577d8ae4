"""FSDP2 applied to a plain Hugging Face causal LM: one group per decoder layer, one for an untied input
embedding, then the root (final norm, output layer, and the embedding when it is tied to the output layer)."""

import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from fsdptrain.config.shared import FSDPConfig
from fsdptrain.distributed.gloo_comms import exchange
from fsdptrain.dtypes import DTYPES, compute_dtype


def decoder_layers(model: nn.Module) -> list:
    """The repeated blocks, found by the class names the model declares unsplittable."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: cannot find its decoder layers")
    return layers


def embeddings_tied(model: nn.Module) -> bool:
    """Whether the input embedding and the output layer share one weight (as the built model has it, whatever the
    config says)."""
    output = model.get_output_embeddings()
    return output is not None and model.get_input_embeddings().weight is output.weight


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, config: FSDPConfig, device: torch.device) -> None:
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=compute_dtype(config.mixed_precision.param_dtype, device), reduce_dtype=DTYPES[config.mixed_precision.reduce_dtype]
        ),
        "reshard_after_forward": config.reshard_after_forward,
    }
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    # An untied embedding in its own group is gathered only around its forward and backward, not held through
    # the whole step with the root. The output layer stays in the root: the chunked loss reads its weight
    # inside the root's gathered region without calling it as a module.
    if not embeddings_tied(model):
        fully_shard(model.get_input_embeddings(), **kwargs)
    fully_shard(model, **kwargs)


def full_parameters(
    model: nn.Module, dtype: torch.dtype | None = None, bucket_bytes: int = 0, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for each parameter of a sharded model (those whose names `keep` accepts, if given), cast
    to `dtype` if given, a bucket at a time.

    Parameters are all-gathered in buckets of about `bucket_bytes` (one collective a bucket; 0: each parameter on
    its own), so at most one bucket of full parameters exists beside the shards (a consumer that keeps them, like
    the HF export, decides what it holds). Shards are cast before they travel. Every rank must iterate: each
    bucket is a collective. A tied weight comes once, under its first name.
    """
    bucket, size = [], 0
    for name, param in model.named_parameters():
        if keep is not None and not keep(name):
            continue
        bucket.append((name, param))
        size += param.numel() * (dtype or param.dtype).itemsize
        if size >= bucket_bytes:
            yield from _gathered(bucket, dtype)
            bucket, size = [], 0
    yield from _gathered(bucket, dtype)


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each buffer in the model's state dict (an MoE router's score correction bias, say): whole
    on every rank, unsharded. Non-persistent buffers (rotary frequencies) are the model's to rebuild."""
    saved = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name in saved:
            yield name, buffer.detach()


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded parameter (or gradient); a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full_tensor(param: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return param.detach()
    local = param.to_local()
    if local.device.type != param.device_mesh.device_type:  # offloaded shards travel through the collective's device
        local = local.to(_mesh_device(param.device_mesh))
        param = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return param.full_tensor()


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)


def _dim0_share(shape: torch.Size, rank: int, world: int) -> int:
    """Elements of a rank's dim-0 shard, split as FSDP2 splits (torch.chunk: ceil(rows / world) rows a rank, the
    last ranks' shares shorter or empty)."""
    rows = -(-shape[0] // world)
    return max(0, min(rows, shape[0] - rank * rows)) * math.prod(shape[1:])


def _gathered(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """A bucket's full parameters: its dim-0 shards over one 1-D mesh in one exchange, anything else alone."""
    sharded = [(n, p) for n, p in bucket if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and p.placements == (Shard(0),)]
    if len({id(p.device_mesh) for _, p in sharded}) > 1:
        sharded = []
    names = {n for n, _ in sharded}
    for name, param in bucket:
        if name not in names:
            full = _full_tensor(param)
            yield name, full if dtype is None else full.to(dtype)
    if not sharded:
        return
    mesh = sharded[0][1].device_mesh
    world, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    device, wire_dtype = _mesh_device(mesh), dtype or sharded[0][1].dtype
    shares = [[_dim0_share(p.shape, r, world) for _, p in sharded] for r in range(world)]
    shards = [p.to_local().detach().reshape(-1) for _, p in sharded]
    if dist.get_backend(group) == "gloo":
        # Each rank's rows of a parameter are one contiguous run of it: receive every run straight into place,
        # without gloo's whole-output temporary or a copy. Each parameter is its own allocation: host memory that
        # the step freed holds parameter-sized pieces, where one bucket-sized block would grow the heap.
        full = [torch.empty(p.numel(), dtype=wire_dtype, device=device) for _, p in sharded]
        starts = [[sum(shares[q][i] for q in range(r)) for r in range(world)] for i in range(len(sharded))]

        def runs(r: int) -> list[torch.Tensor]:
            return [full[i][starts[i][r] : starts[i][r] + shares[r][i]] for i in range(len(sharded)) if shares[r][i]]

        own = runs(rank)
        for run, shard in zip(own, [t for t in shards if t.numel()]):
            run.copy_(shard)  # cast and moved in the one copy
        exchange(group, to_send=lambda peer: own, receive_into=runs)
        for i, (name, param) in enumerate(sharded):
            yield name, full[i].view(param.shape)
        return
    slots = torch.empty(world, max(sum(s) for s in shares), dtype=wire_dtype, device=device)  # rank r's shards in slot r
    torch.cat([t.to(device, wire_dtype) for t in shards], out=slots[rank, : sum(shares[rank])])
    dist.all_gather_into_tensor(slots.view(-1), slots[rank], group=group)
    parts = [slots[r, : sum(shares[r])].split(shares[r]) for r in range(world)]
    for i, (name, param) in enumerate(sharded):
        yield name, torch.cat([parts[r][i] for r in range(world)]).view(param.shape)
