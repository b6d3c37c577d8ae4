"""Token-level negative log-likelihood of a causal LM: the one place both trainers compute it.

The chunked path never holds the (tokens x vocab) logits: it runs the backbone to the last hidden state, keeps
the positions that have a target (prompt tokens need no logits: in chat SFT that skips most of the output
layer's work) and applies the output layer to them chunk by chunk, each chunk's logits recomputed in the
backward (activation checkpointing), so the loss stage peaks at one chunk's logits. Models that transform
logits after the output layer (soft-capping, scaling) take the full-logits path, which is also the reference
the chunked one is tested against.
"""

from functools import partial
from types import MethodType
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.utils.checkpoint import checkpoint

from fsdptrain.data.batching import IGNORE_INDEX

NLL_METHOD = "fsdptrain_nll_sum"


def _chunk_nll_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """sum_t CE(hidden[t] @ weight.T, labels[t]) over labels != IGNORE_INDEX; hidden (T, H), labels (T,)."""
    total = hidden.new_zeros((), dtype=torch.float32)
    # At least one (possibly empty) chunk, so the result stays connected to the graph when no label counts.
    for start in range(0, max(hidden.shape[0], 1), chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_nll_sum, hidden[start:end], weight, labels[start:end], use_reentrant=False)
    return total


def _supports_chunking(model: nn.Module) -> bool:
    config = model.config
    return not getattr(config, "final_logit_softcapping", None) and getattr(config, "logit_scale", None) in (None, 1.0)


def _nll_sum(model: nn.Module, labels: torch.Tensor, chunk_tokens: int, **inputs) -> torch.Tensor:
    if chunk_tokens and _supports_chunking(model):
        hidden = model.base_model(**inputs, use_cache=False).last_hidden_state.flatten(0, 1)
        labels = labels.flatten()
        targets = labels != IGNORE_INDEX
        weight = model.get_output_embeddings().weight
        return chunked_cross_entropy_sum(hidden[targets], weight, labels[targets], chunk_tokens)
    logits = model(**inputs, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def add_nll_forward(model: nn.Module, chunk_tokens: int) -> None:
    """Give `model` the loss method token_nll_sum calls (chunked when chunk_tokens > 0).

    Registered as an FSDP forward method, so FSDP gathers the root's parameters (embeddings, final norm,
    output layer) around it as it does around `forward`; on a plain module the registration does nothing.
    """
    setattr(model, NLL_METHOD, MethodType(partial(_nll_sum, chunk_tokens=chunk_tokens), model))
    register_fsdp_forward_method(model, NLL_METHOD)


def token_nll_sum(model: nn.Module, batch: Dict[str, torch.Tensor], sp_group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Summed cross-entropy (fp32) over the positions whose label is not IGNORE_INDEX.

    With `sp_group` the batch is this rank's sequence slice and the sum covers that slice only.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if sp_group is not None:
        inputs["sp_group"] = sp_group
    return getattr(model, NLL_METHOD)(batch["labels"], **inputs)
