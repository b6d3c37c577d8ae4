"""MoE routers' load-balancing loss, where the model's config asks for it (`output_router_logits`, weighed by its
`router_aux_loss_coef`: Qwen3-MoE, Qwen3-Next, gpt-oss, Mixtral), per sequence.

The loss is the Switch Transformer's as transformers computes it: over every MoE layer's router rows, with f_e the
share of top-k assignments that go to expert e and P_e the mean routing probability of e, E * sum_e f_e * P_e.
transformers takes it over a whole padded batch, whose statistics would change with the micro-batches and ranks a
step is split into. Here each sequence's loss is transformers' over that sequence alone (a sequence split over a
Ulysses group sums its counts and probabilities over the group first), and a step's is their mean over the step's
sequences: the same numbers whatever the layout. The gradient flows through P_e only, as in transformers.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from transformers import PretrainedConfig


@dataclass(frozen=True)
class RouterBalance:
    coef: float  # the config's router_aux_loss_coef
    num_experts: int
    top_k: int


def router_balance(hf_config: PretrainedConfig) -> RouterBalance | None:
    """The config's load-balancing loss, or None where it asks for none (or has no router logits to give)."""
    if not getattr(hf_config, "output_router_logits", False):
        return None
    experts = next((getattr(hf_config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(hf_config, key, None)),
                   None)
    coef = getattr(hf_config, "router_aux_loss_coef", None)
    if not experts or coef is None:
        return None
    return RouterBalance(float(coef), int(experts), int(hf_config.num_experts_per_tok))


def sequence_ids(inputs: dict[str, torch.Tensor], sequences: int, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """Each position's sequence (0 .. sequences - 1; -1 for padding) of a collated micro-batch, flattened as the
    model flattens its rows: a packed row's from its boundaries (this rank's slice of it under Ulysses), padded
    rows' from their attention mask."""
    if "attention_mask" in inputs:
        mask = inputs["attention_mask"].bool()
        rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
        return torch.where(mask, rows, -1).flatten()
    boundaries = inputs["cu_seq_lens_q"].long()
    ids = torch.repeat_interleave(torch.arange(len(boundaries) - 1, device=boundaries.device), boundaries[1:] - boundaries[:-1])
    ids = torch.where(ids < sequences, ids, -1)  # the row's padding to a multiple of the Ulysses size
    chunk = len(ids) // sp_size
    return ids[sp_rank * chunk : (sp_rank + 1) * chunk]


def sequence_losses(router_logits: tuple[torch.Tensor, ...], ids: torch.Tensor, sequences: int, balance: RouterBalance,
                    sp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(sequences,) each sequence's load-balancing loss, from every MoE layer's (positions, experts) router logits
    and each position's sequence `ids` (-1: none)."""
    kept = ids >= 0
    ids = ids[kept]
    device = ids.device
    counts = torch.zeros(sequences, balance.num_experts, device=device)
    probs = torch.zeros(sequences, balance.num_experts, device=device)
    rows = torch.zeros(sequences, device=device)
    for logits in router_logits:
        weights = torch.softmax(logits[kept].float(), dim=-1)
        chosen = torch.topk(weights, balance.top_k, dim=-1).indices
        counts.index_put_((ids[:, None].expand_as(chosen), chosen), torch.ones(chosen.shape, device=device), accumulate=True)
        probs = probs.index_add(0, ids, weights)
        rows += torch.bincount(ids, minlength=sequences).float()
    if sp_group is not None:  # a sequence's slices: its sums over the group (the probabilities' gradient summed back)
        dist.all_reduce(counts, group=sp_group)
        dist.all_reduce(rows, group=sp_group)
        probs = dist_nn.all_reduce(probs, group=sp_group)
    rows = rows.clamp(min=1)[:, None]
    return balance.num_experts * ((counts / rows) * (probs / rows)).sum(dim=1)
