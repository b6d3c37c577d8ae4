"""FSDP2 applied to a plain Hugging Face causal LM: one group per decoder layer, one for an untied input
embedding, then the root (final norm, output layer, and the embedding when it is tied to the output layer)."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from fsdptrain.config.schema import FSDPConfig
from fsdptrain.distributed.gloo_comms import use_gloo_comms

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    if device.type == "cpu":
        use_gloo_comms(model)
