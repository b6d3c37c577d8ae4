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

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


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
