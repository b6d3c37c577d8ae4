"""Token-level negative log-likelihood of a causal LM: the one place both trainers compute it."""

from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from fsdptrain.data.batching import IGNORE_INDEX


def token_nll_sum(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed cross-entropy (fp32) over the positions whose label is not IGNORE_INDEX."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
