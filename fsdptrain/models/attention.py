"""Attention over packed rows: sequences concatenated in one row never attend across their boundaries.

Registered in transformers' AttentionInterface, so every model family that dispatches through it works
unchanged. Boundaries come from `position_ids`, which restart at 0 at each sequence start.
On CUDA with flash-attn installed it calls the varlen kernel; elsewhere it runs SDPA per sequence.
With Ulysses sequence parallelism the model is called with `sp_group=...`, which transformers passes down
to here: the row is then sharded along the sequence and attention runs on a share of the heads instead.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup, get_world_size
from transformers import AttentionInterface

from fsdptrain.distributed.ulysses import gather_sequence, heads_to_seq, seq_to_heads

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # optional GPU extra
    flash_attn_varlen_func = None

PACKED_ATTENTION = "fsdptrain_packed"


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence starts (int32, with the total length last) of a (1, T) packed row."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    total = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([starts, total]).to(torch.int32)


def attend_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scaling: Optional[float],
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each packed sequence. q: (T, H, D), k/v: (T, Hkv, D) -> (T, H, D)."""
    if flash_attn_varlen_func is not None and query.is_cuda:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return flash_attn_varlen_func(
            query, key, value, cu_seqlens, cu_seqlens, max_len, max_len,
            dropout_p=dropout, softmax_scale=scaling, causal=True,
        )
    # split (not slicing) keeps the backward to one concatenation; 4-D inputs with enable_gqa reach SDPA's fused
    # CPU kernel without repeating the KV heads (3-D inputs fall back to the unfused math path).
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outputs = [
        F.scaled_dot_product_attention(
            *(t.transpose(0, 1)[None] for t in (q, k, v)), dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=True
        )[0].transpose(0, 1)
        for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths))
    ]
    return torch.cat(outputs)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    position_ids: Optional[torch.Tensor] = None,
    sp_group: Optional[ProcessGroup] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers' attention signature: q (1, H, T, D), k/v (1, Hkv, T, D) -> ((1, T, H, D), None)."""
    if query.shape[0] != 1 or position_ids is None:
        raise ValueError("packed attention expects one packed row (batch size 1) and its position_ids")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if sp_group is None:
        return attend_packed(q, k, v, cu_seqlens_from_position_ids(position_ids), scaling, dropout)[None], None
    if k.shape[1] % get_world_size(sp_group):  # too few KV heads to split: one per query head
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu_seqlens = cu_seqlens_from_position_ids(gather_sequence(position_ids, sp_group))
    q, k, v = (seq_to_heads(t, sp_group) for t in (q, k, v))
    return heads_to_seq(attend_packed(q, k, v, cu_seqlens, scaling, dropout), sp_group)[None], None


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
