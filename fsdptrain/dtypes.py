"""The dtypes a config can name, and the parameter dtype a model computes in when the config names none."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype(param_dtype: str | None, device: torch.device) -> torch.dtype:
    """`param_dtype`, or by default bf16 on a GPU and fp32 on CPU."""
    return DTYPES[param_dtype or ("bf16" if device.type == "cuda" else "fp32")]
