"""liger-kernel's Triton kernels (RMSNorm, rotary embedding, SwiGLU) in a built model: `model.use_liger=true`.

The losses and log-probs never take liger's (fused linear) cross-entropy: they come from the last hidden state
through the chunked path (models/loss.py), which already never holds the logits. Liger patches the model's
modules in place and, for the rotary embedding, the transformers module of the architecture: every model of that
architecture built later in the process runs it too (liger's kernels compute what transformers' modules compute).
"""

import inspect

import torch
from torch import nn

KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}
FALLBACK = "the model keeps transformers' RMSNorm, rotary embedding and MLP (liger's kernels compute the same)"


def apply_liger_kernels(model: nn.Module, device: torch.device) -> str:
    """Patch `model` (built and sharded) with liger's kernels where they can run; returns what was done, to log."""
    model_type = model.config.model_type
    if device.type != "cuda":
        return f"use_liger=true: liger's Triton kernels need a CUDA device, this run is on {device.type}; {FALLBACK}"
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return f"use_liger=true: liger-kernel is not installed (pip install liger-kernel); {FALLBACK}"
    apply = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if apply is None:
        return f"use_liger=true: liger-kernel has no kernels for model_type {model_type!r}; {FALLBACK}"
    accepted = inspect.signature(apply).parameters
    kernels = {name: on for name, on in KERNELS.items() if name in accepted}
    apply(model=model, **kernels)
    return f"use_liger=true: liger's kernels in the {model_type} model: {', '.join(name for name, on in kernels.items() if on)}"
