"""Token-level losses of a causal LM from its output layer: the one place both trainers compute them.

Two quantities, both over the positions whose label is not IGNORE_INDEX:
- `token_nll_sum`: the summed cross-entropy (SFT). Its chunked kernel computes each chunk's gradients in the
  same pass as its loss, since the upstream gradient of a sum is one scalar: the backward only scales them, and
  the logits are never recomputed.
- `token_log_probs`: per-token log-probs at a temperature, optionally with each position's entropy (RL). Their
  upstream gradient differs per token (ratios, clipping, advantages), so the chunked kernel keeps nothing but its
  inputs and recomputes each chunk's logits in the backward.

The chunked paths run the backbone to the last hidden state, keep the positions that have a target (prompt
tokens need no logits) and apply the output layer chunk by chunk, never holding the (tokens x vocab) logits.
Models that transform logits after the output layer (soft-capping, scaling) take the full-logits path, which is
also the reference the chunked one is tested against.

Losses take the model and its inputs; nothing is attached to the model but one FSDP forward method, registered
on first use, that runs the backbone and hands the hidden state and the output weight to the loss: FSDP gathers
the root's parameters (embeddings, final norm, output layer) around it as it does around `forward`.
"""

from collections.abc import Callable
from types import MethodType, SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import register_fsdp_forward_method

IGNORE_INDEX = -100
HEAD_METHOD = "fsdptrain_forward_head"


# ---- kernels over (tokens, hidden) and the output weight ----------------------------------------------------------
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


def _chunk_log_softmax(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log-softmax of one chunk's logits / temperature, computed in place in one (chunk x vocab) buffer."""
    logits = F.linear(h, weight).float()
    if temperature != 1.0:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=1, out=logits)


def distribution_statistic(log_softmax: torch.Tensor, statistic: str) -> torch.Tensor:
    """Per row of a log-softmax: its distribution's `entropy`, or `sum_pi_squared` (sum over the vocabulary of
    the squared probabilities, the optimal token baseline's)."""
    probs = log_softmax.exp()
    return -(probs * log_softmax).sum(dim=1) if statistic == "entropy" else probs.square().sum(dim=1)


def _as_columns(values: torch.Tensor) -> torch.Tensor:
    """(T,) as a (T, 1) view; (T, K) as it is."""
    return values if values.dim() == 2 else values[:, None]


class _ChunkedTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_tokens, statistic):
        # targets (T,) or (T, K): K tokens' log-probs at each row. The log-probs come out in the targets' shape, not
        # as a view of it: FSDP2 cannot hook the backward of a view that a forward method returns.
        log_probs = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        values = torch.empty(len(targets) if statistic else 0, dtype=torch.float32, device=hidden.device)
        for rows in torch.arange(len(targets), device=hidden.device).split(chunk_tokens):
            log_softmax = _chunk_log_softmax(hidden[rows], weight, temperature)
            _as_columns(log_probs)[rows] = log_softmax.gather(1, _as_columns(targets)[rows])
            if statistic:
                values[rows] = distribution_statistic(log_softmax, statistic)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)  # an output outside the loss (the entropy as a metric) costs no backward work
        if statistic != "entropy":  # the backward knows the entropy's gradient alone
            ctx.mark_non_differentiable(values)
        return log_probs, values

    @staticmethod
    def backward(ctx, log_probs_grad: torch.Tensor, entropy_grad: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden, grad_weight = ctx.needs_input_grad[:2]
        hidden_grad = torch.zeros_like(hidden) if grad_hidden else None
        weight_grad = torch.zeros_like(weight) if grad_weight else None
        with_entropy = entropy_grad is not None and entropy_grad.numel() > 0
        if log_probs_grad is None:
            log_probs_grad = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        for rows in torch.arange(len(targets), device=hidden.device).split(ctx.chunk_tokens):
            h, y, g = hidden[rows], _as_columns(targets)[rows], _as_columns(log_probs_grad)[rows]
            g_sum = g.sum(dim=1, keepdim=True)
            log_softmax = _chunk_log_softmax(h, weight, ctx.temperature)
            # With z = logits / temperature: d log p_y / dz = onehot(y) - p, and d H / dz = -p (log p + H).
            if with_entropy:
                probs = log_softmax.exp()
                entropy = -(probs * log_softmax).sum(dim=1, keepdim=True)
                z_grad = log_softmax.add_(entropy).mul_(probs).mul_(-entropy_grad[rows, None]).sub_(probs.mul_(g_sum))
            else:
                z_grad = log_softmax.exp_().mul_(-g_sum)
            z_grad.scatter_add_(1, y, g)
            if ctx.temperature != 1.0:
                z_grad.div_(ctx.temperature)
            logits_grad = z_grad.to(h.dtype)
            if grad_hidden:
                hidden_grad[rows] = logits_grad @ weight
            if grad_weight:
                weight_grad.addmm_(logits_grad.T, h)
        return hidden_grad, weight_grad, None, None, None, None


def chunked_token_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_tokens: int, statistic: str | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden[t] @ weight.T / temperature)[targets[t]] for every row t, fp32, shape (T,) (or (T, K) for
    targets (T, K): K tokens of each row); with a `statistic` (distribution_statistic's) also that of each row's
    distribution (else None). The backward takes any per-token upstream gradient (and the entropy's) and
    recomputes the logits chunk by chunk."""
    log_probs, values = _ChunkedTokenLogProbs.apply(hidden, weight, targets, temperature, chunk_tokens, statistic)
    return log_probs, values if statistic else None


# ---- the model's side: backbone, then a loss over the output layer ------------------------------------------------
def _forward_head(self: nn.Module, head: Callable[[torch.Tensor, torch.Tensor], Any], router: SimpleNamespace, **inputs) -> Any:
    output = self.base_model(**inputs, use_cache=False)
    router.logits = router_logits(output)
    return head(output.last_hidden_state.flatten(0, 1), self.get_output_embeddings().weight)


def router_logits(output: Any) -> tuple[torch.Tensor, ...]:
    """Each MoE layer's router logits of a forward's output (none from a model that gives none)."""
    return getattr(output, "router_logits", None) or ()


def forward_head(model: nn.Module, inputs: dict[str, Any], head: Callable[[torch.Tensor, torch.Tensor], Any], router: list | None = None) -> Any:
    """head(last hidden state (T, H) of the flattened batch, output weight (V, H)), inside FSDP's gathered region;
    with a `router` list, each MoE layer's router logits are appended to it."""
    if HEAD_METHOD not in vars(model):
        setattr(model, HEAD_METHOD, MethodType(_forward_head, model))
        register_fsdp_forward_method(model, HEAD_METHOD)  # does nothing on a plain module
    # the router logits come back in a namespace: FSDP's forward hooks rebuild lists among the arguments (tree_map)
    captured = SimpleNamespace(logits=())
    result = getattr(model, HEAD_METHOD)(head, captured, **inputs)
    if router is not None:
        router.extend(captured.logits)
    return result


def full_logits(model: nn.Module, inputs: dict[str, Any], router: list | None) -> torch.Tensor:
    """The model's logits of the batch; with a `router` list, each MoE layer's router logits appended to it."""
    output = model(**inputs, use_cache=False)
    if router is not None:
        router.extend(router_logits(output))
    return output.logits


def with_router(inputs: dict[str, Any], router: list | None) -> dict[str, Any]:
    return inputs if router is None else {**inputs, "output_router_logits": True}


def supports_chunking(model: nn.Module) -> bool:
    config = model.config
    return not getattr(config, "final_logit_softcapping", None) and getattr(config, "logit_scale", None) in (None, 1.0)


def with_sp_group(inputs: dict[str, Any], sp_group: ProcessGroup | None) -> dict[str, Any]:
    """A model's keyword arguments for this rank's slice of a Ulysses group's rows (`sp_group`), or as they are."""
    return inputs if sp_group is None else {**inputs, "sp_group": sp_group}


def token_nll_sum(
    model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunk_tokens: int, sp_group: ProcessGroup | None = None,
    router: list | None = None,
) -> torch.Tensor:
    """Summed cross-entropy (fp32) over the positions whose label is not IGNORE_INDEX; chunked when chunk_tokens > 0.

    With `sp_group` the batch is this rank's sequence slice and the sum covers that slice only. With a `router`
    list, each MoE layer's router logits are appended to it (models/router_balance.py).
    """
    inputs = with_router(with_sp_group(inputs, sp_group), router)
    labels = labels.flatten()
    if chunk_tokens and supports_chunking(model):
        return forward_head(model, inputs, lambda hidden, weight: chunked_cross_entropy_sum(hidden, weight, labels, chunk_tokens), router)
    logits = full_logits(model, inputs, router)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def token_log_probs(
    model: nn.Module,
    inputs: dict[str, Any],
    labels: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool = False,
    sp_group: ProcessGroup | None = None,
    token_rows: torch.Tensor | None = None,
    with_sum_pi_squared: bool = False,
    router: list | None = None,
    other_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position log-prob of each label at `temperature` (fp32, the labels' flattened shape (T,), 0 where the
    label is IGNORE_INDEX), and with `with_entropy` each position's entropy (0 there too), or with
    `with_sum_pi_squared` the sum of its squared probabilities (no gradient), else None. With `other_tokens`
    (T, K), K more token ids at each position, the log-probs are (T, 1 + K): the label's, then theirs.

    `token_rows` gives the row position of each label's position where a packed row shares prompts (the
    micro-batch's `token_rows`); without it the labels are aligned with the flattened batch. With a `router` list,
    each MoE layer's router logits are appended to it."""
    inputs = with_router(with_sp_group(inputs, sp_group), router)
    labels = labels.flatten()
    rows = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    hidden_rows = rows if token_rows is None else token_rows[rows]

    def scatter(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        return values.new_zeros((len(labels), *values.shape[1:])).index_put((rows,), values)

    assert not (with_entropy and with_sum_pi_squared), "one statistic a pass"
    statistic = "entropy" if with_entropy else "sum_pi_squared" if with_sum_pi_squared else None
    targets = labels[rows, None] if other_tokens is None else torch.cat([labels[rows, None], other_tokens.flatten(0, -2)[rows]], dim=1)
    if chunk_tokens and supports_chunking(model):
        def head(hidden: torch.Tensor, weight: torch.Tensor):
            return chunked_token_log_probs(hidden[hidden_rows], weight, targets, temperature, chunk_tokens, statistic)
        log_probs, values = forward_head(model, inputs, head, router)
    else:
        logits = full_logits(model, inputs, router).flatten(0, 1)[hidden_rows].float() / temperature
        log_softmax = logits.log_softmax(dim=1)
        log_probs = log_softmax.gather(1, targets)
        values = distribution_statistic(log_softmax, statistic) if statistic else None
        if statistic == "sum_pi_squared":
            values = values.detach()
    return scatter(log_probs if other_tokens is not None else log_probs[:, 0]), scatter(values)


@torch.no_grad()
def token_top_k(
    model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, k: int, chunk_tokens: int, sp_group: ProcessGroup | None = None,
    token_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """At each position with a label (as token_log_probs aligns them), the model's k most likely next tokens: their
    log-probs (fp32, (T, k), descending) and ids ((T, k)); zeros where the label is IGNORE_INDEX."""
    labels = labels.flatten()
    rows = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    hidden_rows = rows if token_rows is None else token_rows[rows]
    inputs = with_sp_group(inputs, sp_group)

    def top(log_softmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return log_softmax.topk(k, dim=1)

    if chunk_tokens and supports_chunking(model):
        def head(hidden: torch.Tensor, weight: torch.Tensor):
            pieces = [top(_chunk_log_softmax(hidden[chunk], weight, 1.0)) for chunk in hidden_rows.split(chunk_tokens)]
            return (torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])) if pieces else top(hidden.new_zeros((0, k)).float())
        values, ids = forward_head(model, inputs, head)
    else:
        values, ids = top(full_logits(model, inputs, None).flatten(0, 1)[hidden_rows].float().log_softmax(dim=1))
    scatter = lambda x: x.new_zeros((len(labels), k)).index_put((rows,), x)  # noqa: E731
    return scatter(values), scatter(ids)
