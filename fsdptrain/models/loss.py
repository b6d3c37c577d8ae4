"""Token-level negative log-likelihood of a causal LM: the one place both trainers compute it.

The chunked path never holds the (tokens x vocab) logits: it runs the backbone to the last hidden state, keeps
the positions that have a target (prompt tokens need no logits: in chat SFT that skips most of the output
layer's work) and applies the output layer to them chunk by chunk, so the loss stage peaks at one chunk's
logits. The loss is a sum, so each chunk's gradients (hidden state and output layer) are computed in the same
pass as its loss, and the backward only scales them: the logits are never recomputed (activation
checkpointing would compute the output layer's forward twice). Models that transform logits after the output
layer (soft-capping, scaling) take the full-logits path, which is also the reference the chunked one is tested
against.
"""

from functools import partial
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import register_fsdp_forward_method

from fsdptrain.data.batching import IGNORE_INDEX

NLL_METHOD = "fsdptrain_nll_sum"


def _loss_and_grads(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, grad_hidden: bool, grad_weight: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The summed loss over labels != IGNORE_INDEX, and its gradients where asked for (zeros when no label counts,
    so every rank hands FSDP a gradient to reduce)."""
    targets = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    hidden_grad = torch.zeros_like(hidden) if grad_hidden else None
    weight_grad = torch.zeros_like(weight) if grad_weight else None
    for rows in targets.split(chunk_tokens):
        h, y = hidden[rows], labels[rows]
        logits = F.linear(h, weight).float()
        log_normalizer = logits.logsumexp(dim=1)
        total += (log_normalizer - logits.gather(1, y[:, None]).squeeze(1)).sum()
        if not (grad_hidden or grad_weight):
            continue
        probs = logits.sub_(log_normalizer[:, None]).exp_()
        probs[torch.arange(len(y), device=y.device), y] -= 1  # d loss / d logits = softmax - one-hot
        logits_grad = probs.to(h.dtype)
        if grad_hidden:
            hidden_grad[rows] = logits_grad @ weight
        if grad_weight:
            weight_grad.addmm_(logits_grad.T, h)
    return total, hidden_grad, weight_grad


class _ChunkedCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        total, ctx.hidden_grad, ctx.weight_grad = _loss_and_grads(hidden, weight, labels, chunk_tokens, *ctx.needs_input_grad[:2])
        return total

    @staticmethod
    def backward(ctx, total_grad: torch.Tensor):
        # Handed over, not kept: with no other reference left autograd adopts the buffer as the weight's gradient
        # instead of copying it. A second backward through the same graph is therefore not supported.
        hidden_grad, weight_grad, ctx.hidden_grad, ctx.weight_grad = ctx.hidden_grad, ctx.weight_grad, None, None
        return (
            None if hidden_grad is None else hidden_grad.mul_(total_grad),
            None if weight_grad is None else weight_grad.mul_(total_grad),
            None,
            None,
        )


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """sum_t CE(hidden[t] @ weight.T, labels[t]) over labels != IGNORE_INDEX; hidden (T, H), labels (T,).

    With gradients enabled they are computed here, chunk by chunk (see the module's docstring)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropySum.apply(hidden, weight, labels, chunk_tokens)
    return _loss_and_grads(hidden, weight, labels, chunk_tokens, grad_hidden=False, grad_weight=False)[0]


def _supports_chunking(model: nn.Module) -> bool:
    config = model.config
    return not getattr(config, "final_logit_softcapping", None) and getattr(config, "logit_scale", None) in (None, 1.0)


def _nll_sum(model: nn.Module, labels: torch.Tensor, chunk_tokens: int, **inputs) -> torch.Tensor:
    if chunk_tokens and _supports_chunking(model):
        hidden = model.base_model(**inputs, use_cache=False).last_hidden_state.flatten(0, 1)
        return chunked_cross_entropy_sum(hidden, model.get_output_embeddings().weight, labels.flatten(), chunk_tokens)
    logits = model(**inputs, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def add_nll_forward(model: nn.Module, chunk_tokens: int) -> None:
    """Give `model` the loss method token_nll_sum calls (chunked when chunk_tokens > 0).

    Registered as an FSDP forward method, so FSDP gathers the root's parameters (embeddings, final norm,
    output layer) around it as it does around `forward`; on a plain module the registration does nothing.
    """
    setattr(model, NLL_METHOD, MethodType(partial(_nll_sum, chunk_tokens=chunk_tokens), model))
    register_fsdp_forward_method(model, NLL_METHOD)


def token_nll_sum(model: nn.Module, batch: dict[str, torch.Tensor], sp_group: ProcessGroup | None = None) -> torch.Tensor:
    """Summed cross-entropy (fp32) over the positions whose label is not IGNORE_INDEX.

    With `sp_group` the batch is this rank's sequence slice and the sum covers that slice only.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if sp_group is not None:
        inputs["sp_group"] = sp_group
    return getattr(model, NLL_METHOD)(batch["labels"], **inputs)
