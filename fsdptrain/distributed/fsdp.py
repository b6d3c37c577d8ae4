"""FSDP2 applied to a plain Hugging Face causal LM: one group per decoder layer, one for an untied input
embedding, then the root (final norm, output layer, and the embedding when it is tied to the output layer)."""

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdptrain.config.schema import DTYPES, FSDPConfig


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
    param_dtype = config.mixed_precision.param_dtype or ("bf16" if device.type == "cuda" else "fp32")
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[config.mixed_precision.reduce_dtype]
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


def full_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for each parameter of a sharded model, one at a time, cast to `dtype` if given.

    Each parameter is all-gathered on its own, so at most one full parameter exists beside the shards (a consumer
    that keeps them, like the HF export, decides what it holds). Every rank must iterate: each step is a
    collective. A tied weight comes once, under its first name.
    """
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            local = param.to_local()
            mesh_device = param.device_mesh.device_type
            if local.device.type != mesh_device:  # offloaded shards travel through the collective's device
                local = local.to(mesh_device)
            param = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
            full = param.full_tensor()
        else:
            full = param.detach()
        yield name, full if dtype is None else full.to(dtype)
