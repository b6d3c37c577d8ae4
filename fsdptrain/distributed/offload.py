"""verl's `param_offload` and `optimizer_offload`: a sharded model's parameters (with their gradients) and its
optimizer's state leave the accelerator for host memory between the phases of an RL step that use them, and come
back for those phases, whose forward, backward and optimizer step run on the accelerator as without offload. The
accelerator's memory is then free for the phases that need it most: the rollout engine's key/value cache, the
other models' passes.

FSDP2's CPUOffloadPolicy (`fsdp_config.cpu_offload`, verl's `offload_policy`) is another thing: there the shards
live in host memory for good, each layer is copied in for its passes and the optimizer steps on the CPU.

On a CPU device every move is to where the tensors already are: nothing moves.
"""

from dataclasses import dataclass

import torch
from torch import nn

HOST = torch.device("cpu")


def move_parameters(model: nn.Module, device: torch.device) -> None:
    """The model's parameter shards, their gradients and its buffers onto `device` (FSDP2 keeps its sharded
    parameters across the move)."""
    model.to(device)
    release_cached(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """The optimizer's state tensors onto `device`, AdamW's step counts aside (they stay where the optimizer keeps
    them)."""
    for state in optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and name != "step":
                state[name] = value.to(device, non_blocking=True)
    release_cached(device)


def release_cached(device: torch.device) -> None:
    """After a move to the host, hand the freed accelerator blocks back, so that another phase can have them."""
    if device == HOST and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass
class PhaseOffload:
    """One model's offload between phases: whether its parameters (`params`) and its optimizer's state
    (`optimizer_state`, a trained model's) leave `device` when `leave` is called, and return with `params_back` and
    `optimizer_back`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    params: bool
    optimizer_state: bool
    device: torch.device

    def leave(self) -> None:
        if self.params:
            move_parameters(self.model, HOST)
        if self.optimizer_state and self.optimizer is not None:
            move_optimizer_state(self.optimizer, HOST)

    def params_back(self) -> None:
        if self.params:
            move_parameters(self.model, self.device)

    def optimizer_back(self) -> None:
        if self.optimizer_state and self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.device)
