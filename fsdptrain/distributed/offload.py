"""verl's `param_offload` and `optimizer_offload`: a sharded model's parameters (with their gradients) and its
optimizer's state leave the accelerator for host memory between the phases of an RL step that use them, and come
back for those phases, whose forward, backward and optimizer step run on the accelerator as without offload. The
accelerator's memory is then free for the phases that need it most: the rollout engine's key/value cache, the
other models' passes.

A departure copies each tensor's whole storage into a pinned host buffer made at the first departure and reused,
then frees the storage on the accelerator (resized to nothing); a return gives it back its bytes and copies them in.
The tensors themselves stay where they are, so FSDP2's sharded parameters and the optimizer's state keep their
identity, their device and their padding, and nothing but the bytes moves. (`module.to("cpu")` would copy into
pageable memory allocated afresh each time, several times slower: docs/performance.md.)

FSDP2's CPUOffloadPolicy (`fsdp_config.cpu_offload`, verl's `offload_policy`) is another thing: there the shards
live in host memory for good, each layer is copied in for its passes and the optimizer steps on the CPU.

On a CPU device nothing moves: nothing is on an accelerator.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdptrain.distributed.fsdp import decoder_layers


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage under `tensor` (an FSDP2 shard's padding included)."""
    storage = local_tensor(tensor).untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class HostCopies:
    """Pinned host buffers for a list of accelerator tensors' storages, by position in the list (the order of a
    model's parameters and an optimizer's state is fixed), made once and remade only where a storage's size
    changed (an optimizer's state appears after its first step)."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    sizes: list[int] | None = None  # each storage's bytes while they are away; None while they are home

    @property
    def away(self) -> bool:
        return self.sizes is not None

    def park(self, tensors: list[torch.Tensor]) -> None:
        pointers = [local_tensor(t).untyped_storage().data_ptr() for t in tensors]
        shared = len({p for p in pointers if p}) < sum(1 for p in pointers if p)
        assert not shared, "two offloaded tensors share a storage: parking one would free the other's bytes"
        self.sizes = []
        for i, tensor in enumerate(tensors):
            data = storage_bytes(tensor)
            if i == len(self.buffers):
                self.buffers.append(torch.empty(0, dtype=torch.uint8))
            if self.buffers[i].numel() != data.numel():
                self.buffers[i] = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self.buffers[i].copy_(data, non_blocking=True)
            # The copy is queued on the current stream, as is any later use of the freed blocks: no wait needed.
            local_tensor(tensor).untyped_storage().resize_(0)
            self.sizes.append(data.numel())

    def restore(self, tensors: list[torch.Tensor]) -> None:
        assert self.sizes is not None and len(tensors) == len(self.sizes), "the tensors parked and those restored differ"
        for tensor, buffer, size in zip(tensors, self.buffers, self.sizes):
            local_tensor(tensor).untyped_storage().resize_(size)
            storage_bytes(tensor).copy_(buffer, non_blocking=True)
        self.sizes = None


def on_accelerator(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those in the accelerator's memory: a model under FSDP2's CPU offload (`cpu_offload`) keeps its shards and
    optimizer state in host memory already."""
    return [t for t in tensors if local_tensor(t).device.type != "cpu"]


def parameters_and_gradients(model: nn.Module) -> list[torch.Tensor]:
    return [t for p in model.parameters() for t in (p, p.grad) if t is not None]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """AdamW's moments and the like; its step counts aside (they stay where the optimizer keeps them)."""
    return [value for state in optimizer.state.values() for name, value in state.items()
            if isinstance(value, torch.Tensor) and name != "step"]


def release_cached() -> None:
    """After a departure, hand the freed accelerator blocks back, so that another phase (an inference engine with
    its own allocator) can have them."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass
class PhaseOffload:
    """One model's offload between phases: whether its parameters (`params`) and its optimizer's state
    (`optimizer_state`, a trained model's) leave the accelerator when `leave` is called, and return with
    `params_back` and `optimizer_back`. What is in host memory already stays (a model on a CPU device: nothing
    moves)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    params: bool
    optimizer_state: bool
    parked_params: HostCopies = field(default_factory=HostCopies)
    parked_optimizer: HostCopies = field(default_factory=HostCopies)

    def leave(self) -> None:
        if self.params and not self.parked_params.away:
            for module in self.model.modules():  # the sharded parameters registered, not gathered ones
                if isinstance(module, FSDPModule):
                    module.reshard()
            self.parked_params.park(on_accelerator(parameters_and_gradients(self.model)))
        if self.optimizer_state and self.optimizer is not None and not self.parked_optimizer.away:
            self.parked_optimizer.park(on_accelerator(optimizer_tensors(self.optimizer)))
        if self.parked_params.away or self.parked_optimizer.away:
            release_cached()

    def params_back(self) -> None:
        if self.parked_params.away:
            self.parked_params.restore(on_accelerator(parameters_and_gradients(self.model)))

    def optimizer_back(self) -> None:
        if self.parked_optimizer.away:
            self.parked_optimizer.restore(on_accelerator(optimizer_tensors(self.optimizer)))


# ---- activations ---------------------------------------------------------------------------------------------------
def offload_activations(model: nn.Module, device: torch.device) -> None:
    """verl's enable_activation_offload: what each decoder layer keeps for its backward waits in host memory.

    Under gradient checkpointing a layer keeps only its input, which the checkpoint holds until the backward: the
    checkpoint is handed a host copy, and the layer copies it back at the start of its forward and of its
    recomputation. Without checkpointing, every tensor the layer saves for its backward is packed into host memory
    (torch's save_on_cpu) and unpacked in the backward. On a CPU device activations already are in host memory:
    nothing moves."""
    if device.type == "cpu":
        return
    pin = device.type == "cuda"
    for layer in decoder_layers(model):
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) and checkpoint is not None:
            layer._gradient_checkpointing_func = partial(checkpoint_from_host, checkpoint)
        else:
            layer.register_forward_pre_hook(partial(_pack_to_host, pin))
            layer.register_forward_hook(_stop_packing, always_call=True)


def checkpoint_from_host(checkpoint: Callable, function: Callable, hidden_states: torch.Tensor | None = None, *args: Any) -> Any:
    """`checkpoint(function, hidden_states, *args)` holding a host copy of the layer's input in place of it."""
    if hidden_states is None or not hidden_states.is_floating_point() or hidden_states.device.type == "cpu":
        return checkpoint(function, *([] if hidden_states is None else [hidden_states]), *args)
    device = hidden_states.device
    return checkpoint(lambda host, *rest: function(host.to(device, non_blocking=True), *rest), hidden_states.to("cpu"), *args)


def _pack_to_host(pin: bool, layer: nn.Module, args: tuple) -> None:
    layer.packing_to_host = torch.autograd.graph.save_on_cpu(pin_memory=pin)
    layer.packing_to_host.__enter__()


def _stop_packing(layer: nn.Module, args: tuple, output: Any) -> None:
    layer.packing_to_host.__exit__(None, None, None)
