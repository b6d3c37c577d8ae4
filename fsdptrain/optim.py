"""AdamW, the learning-rate schedules, and the clipped optimizer step."""

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from fsdptrain.config.shared import OptimConfig
from fsdptrain.models.added_tokens import TrainedRows


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (all of them, or a LoRA model's adapters)."""
    # The fused kernel (CPU and CUDA) updates each parameter in one pass instead of a dozen elementwise ops.
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay, fused=True
    )


def warmup_steps(config: OptimConfig, total_steps: int) -> int:
    """verl's rule: optim.lr_warmup_steps where positive; null, 0 or negative take lr_warmup_steps_ratio of the steps."""
    if config.lr_warmup_steps is not None and config.lr_warmup_steps > 0:
        return config.lr_warmup_steps
    return int(config.lr_warmup_steps_ratio * total_steps)


def lr_factor(step: int, config: OptimConfig, total_steps: int) -> float:
    """The learning rate at optimizer step `step` (0-based) as a fraction of optim.lr: verl's schedules (the
    warm-up rises linearly from 0, its first step included, as verl's zero-indexed count)."""
    warmup = warmup_steps(config, total_steps)
    if step < warmup:
        return step / warmup
    floor = config.min_lr_ratio
    if config.lr_scheduler == "constant":
        return 1.0
    if config.lr_scheduler == "cosine":
        progress = (step - warmup) / max(1, total_steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    decay = max(1, round(config.wsd_decay_ratio * total_steps))  # wsd: warmup, stable, then linear decay
    decay_start = max(warmup, total_steps - decay)
    if step < decay_start:
        return 1.0
    return floor + (1 - floor) * max(0.0, 1 - (step - decay_start) / decay)


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, config, total_steps))


def gradient_norm(model: nn.Module) -> float:
    """The global L2 norm of the (sharded) gradients, summed in fp64: torch's fp32 norm is off by up to ~5e-5 of
    itself on CPU (an embedding's gradient, mostly zero rows), differently for each layout's shards, where the fp64
    norm of the same gradients agrees across layouts and with a plain sum of squares to ~1e-7."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
    norm = torch.linalg.vector_norm(norms)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def clipped_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, trained_rows: TrainedRows | None = None) -> tuple[float, bool]:
    """Clip on the global norm of the sharded gradients and step; a non-finite norm skips the update. With
    `trained_rows` (freeze_llm), the frozen rows' gradients are dropped before the norm and their values kept
    through the step.

    Returns (grad_norm, applied). The LR schedule is the caller's to advance, once per training step whether or
    not the update was applied (GRPO makes several optimizer steps in one training step).
    """
    if trained_rows is not None:
        trained_rows.mask_gradients()
    norm = gradient_norm(model)
    applied = math.isfinite(norm)
    if applied:
        nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, torch.tensor(norm, dtype=torch.float32))
        optimizer.step()
        if trained_rows is not None:
            trained_rows.restore_frozen()
    optimizer.zero_grad(set_to_none=True)
    return norm, applied
