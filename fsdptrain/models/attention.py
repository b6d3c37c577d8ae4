"""Two attention functions registered in transformers' AttentionInterface, so that every model family that
dispatches through it can use them unchanged.

Attention over packed rows (training): sequences concatenated in one row never attend across their boundaries.
Boundaries come from transformers' flash-attention kwargs `cu_seq_lens_q` / `max_length_q` where the
caller computed them on the host (the trainer does, once per micro-batch: derived on the GPU in every layer they
would cost two device syncs a layer), else from `position_ids`, which restart at 0 at each sequence start.
On CUDA in bf16/fp16 it calls a varlen flash kernel (flash-attn's where installed, else torch's own from torch
2.10); elsewhere it runs SDPA per sequence, which on a GPU costs a kernel launch per sequence and layer.
With Ulysses sequence parallelism the model is called with `sp_group=...`, which transformers passes down
to here: the row is then sharded along the sequence and attention runs on a share of the heads instead.

A row may also hold a prompt once for several responses (RL groups, see data.micro_batches): then `key_rows`
lists, sequence after sequence, the row positions each sequence attends to (its prompt's, then its own), and
`cu_seq_lens_k` / `max_length_k` describe those key sequences. A response's queries are its own tokens only, so
its causal mask is aligned to the bottom right: its k-th token sees the prompt and its own first k tokens.

Both honour what a model's layer asks of its attention beyond Llama's: a `sliding_window` (a query sees the last
`sliding_window` keys, itself included, as transformers' masks and flash kwargs define it: Mistral, Qwen2/3's
windowed layers, gpt-oss, Gemma 3), attention sinks `s_aux` (gpt-oss: one learned logit a head that joins each
softmax's denominator and attends to nothing) and value heads of their own size (MLA: DeepSeek-V3). The fused
kernels take a window but no sinks: with sinks a sequence's attention is computed explicitly, as transformers'
eager attention computes it.

Grouped attention over a padded batch (the HF rollout engine's prefill and decoding on a CPU): transformers' eager
attention with the query heads that share a KV head as rows of one matmul. Eager attention repeats each KV head
for its query heads, a copy of the whole cache at every layer and decoding step that costs more than the
attention itself; SDPA's fused CPU kernel is slow for the one-token queries of decoding.
"""

import inspect

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup, get_rank, get_world_size
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from fsdptrain.distributed.ulysses import gather_sequence, heads_to_seq, seq_to_heads

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # optional GPU extra
    flash_attn_varlen_func = None
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None
# varlen_attn's signature still moves: causality is is_causal in torch 2.10 and window_size after it; 2.11 has no
# enable_gqa. The call below reads which keywords this torch has.
VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()

PACKED_ATTENTION = "fsdptrain_packed"
GROUPED_ATTENTION = "fsdptrain_grouped"


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence starts (int32, with the total length last) of a (1, T) packed row."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    total = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([starts, total]).to(torch.int32)


def max_seqlen(cu_seqlens: torch.Tensor) -> int:
    """The longest sequence of a packed row, from its cumulative starts (a device sync when they are on a GPU)."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def repeat_kv_heads(key: torch.Tensor, value: torch.Tensor, query_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, Hkv, D) keys and values with each head repeated to one per query head, for kernels without GQA."""
    groups = query_heads // key.shape[1]
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def attend_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scaling: float | None,
    dropout: float = 0.0,
    max_len: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_len_k: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence. q: (T, H, D), k: (Tk, Hkv, D), v: (Tk, Hkv, Dv) -> (T, H, Dv).

    Without `cu_seqlens_k` the key sequences are the query sequences. With it, the i-th sequence's keys may be
    longer than its queries (a shared prompt's), and the queries are its last keys (bottom-right causal mask).
    `sliding_window` and `sinks` (one logit a query head) as the module's docstring says."""
    if cu_seqlens_k is None:
        cu_seqlens_k, max_len_k = cu_seqlens, max_len
    half = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
    use_flash_attn = half and sinks is None and flash_attn_varlen_func is not None
    use_torch_varlen = (half and sinks is None and varlen_attn is not None and dropout == 0.0 and (scaling is None or "scale" in VARLEN_PARAMS)
                        and (sliding_window is None or "window_size" in VARLEN_PARAMS))
    if use_flash_attn or use_torch_varlen:
        max_len = max_seqlen(cu_seqlens) if max_len is None else max_len
        max_len_k = max_seqlen(cu_seqlens_k) if max_len_k is None else max_len_k
        value_dim = value.shape[-1]
        if value_dim != query.shape[-1]:  # the kernels take one head size: MLA's narrower values padded, the output cut back
            value = F.pad(value, (0, query.shape[-1] - value_dim))
        window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
        if use_flash_attn:  # flash-attn >= 2.1 aligns a causal mask of fewer queries than keys to the bottom right
            output = flash_attn_varlen_func(
                query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len_k,
                dropout_p=dropout, softmax_scale=scaling, causal=True, window_size=window,
            )
        else:
            output = torch_varlen_causal(query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len_k, scaling, window)
        return output[..., :value_dim]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    key_lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    # split (not slicing) keeps the backward to one concatenation
    return torch.cat([
        attend_one(q, k, v, scaling, dropout, sliding_window, sinks)
        for q, k, v in zip(query.split(lengths), key.split(key_lengths), value.split(key_lengths))
    ])


def attend_one(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, dropout: float,
               sliding_window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One sequence's causal attention, its queries the last of its keys: q (Q, H, D), k/v (K, Hkv, D/Dv) -> (Q, H, Dv).

    Without sinks, 4-D inputs with enable_gqa reach SDPA's fused CPU kernel without repeating the KV heads (3-D
    inputs fall back to the unfused math path). With sinks, the softmax is written out as gpt-oss's eager
    attention writes it: the sink's logit joins the denominator and its column is dropped."""
    queries, keys = len(query), len(key)
    plain_causal = queries == keys and sliding_window is None
    mask = None if plain_causal and sinks is None else causal_mask(queries, keys, sliding_window, query.device)
    if sinks is None:
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        output = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, enable_gqa=True, is_causal=plain_causal, attn_mask=mask)
        return output[0].transpose(0, 1)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, *repeat_kv_heads(key, value, query.shape[1])))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = torch.matmul(q, k.transpose(2, 3)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    sink_column = sinks.reshape(1, -1, 1, 1).expand(1, -1, queries, 1).to(logits.dtype)
    combined = torch.cat([logits, sink_column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    weights = F.softmax(combined, dim=-1, dtype=torch.float32).to(q.dtype)[..., :-1]
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, v)[0].transpose(0, 1)


def causal_mask(queries: int, keys: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """(queries, keys) boolean mask where query i, at key position keys - queries + i, sees the keys up to it (SDPA's
    is_causal aligns top-left) and, with a window, only the last `sliding_window` of them."""
    mask = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
    if sliding_window is not None:
        mask = mask.triu(keys - queries - sliding_window + 1)
    return mask


def torch_varlen_causal(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, max_len: int,
    max_len_k: int, scaling: float | None, window: tuple[int, int] = (-1, 0)
) -> torch.Tensor:
    """torch's varlen flash kernel (CUDA, bf16/fp16), whichever of its signatures this torch has; like flash-attn,
    whose kernels it runs, it aligns the causal mask to the bottom right. A `window` other than (-1, 0) needs a
    torch whose kernel takes window_size."""
    kwargs = {"window_size": window} if "window_size" in VARLEN_PARAMS else {"is_causal": True}
    if scaling is not None:
        kwargs["scale"] = scaling
    if "enable_gqa" in VARLEN_PARAMS:
        kwargs["enable_gqa"] = True
    elif key.shape[1] != query.shape[1]:
        key, value = repeat_kv_heads(key, value, query.shape[1])
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens_k, max_len, max_len_k, **kwargs)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    sp_group: ProcessGroup | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_k: int | None = None,
    key_rows: torch.Tensor | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q (1, H, T, D), k/v (1, Hkv, T, D) -> ((1, T, H, D), None).

    With `sp_group`, `cu_seq_lens_q` describes the whole row, not this rank's slice of it. `key_rows` (with
    `cu_seq_lens_k`) is a shared-prompt row's key layout; `sliding_window` and the sinks `s_aux`: see the module's
    docstring."""
    if query.shape[0] != 1 or (position_ids is None and cu_seq_lens_q is None):
        raise ValueError("packed attention expects one packed row (batch size 1) and its position_ids or cu_seq_lens_q")
    if key_rows is not None and (sp_group is not None or cu_seq_lens_q is None or cu_seq_lens_k is None):
        raise ValueError("shared-prompt rows (key_rows) need cu_seq_lens_q and cu_seq_lens_k, and no sequence parallelism")
    if cu_seq_lens_q is None:
        whole_row = position_ids if sp_group is None else gather_sequence(position_ids, sp_group)
        cu_seq_lens_q = cu_seqlens_from_position_ids(whole_row)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if key_rows is not None:
        k, v = k[key_rows], v[key_rows]
        return attend_packed(q, k, v, cu_seq_lens_q, scaling, dropout, max_length_q, cu_seq_lens_k, max_length_k, sliding_window, s_aux)[None], None
    if sp_group is None:
        return attend_packed(q, k, v, cu_seq_lens_q, scaling, dropout, max_length_q, sliding_window=sliding_window, sinks=s_aux)[None], None
    if k.shape[1] % get_world_size(sp_group):  # too few KV heads to split: one per query head
        k, v = repeat_kv_heads(k, v, q.shape[1])
    if s_aux is not None:  # this rank's share of the heads keeps its heads' sinks
        share = q.shape[1] // get_world_size(sp_group)
        s_aux = s_aux[share * get_rank(sp_group) : share * (get_rank(sp_group) + 1)]
    q, k, v = (seq_to_heads(t, sp_group) for t in (q, k, v))
    output = attend_packed(q, k, v, cu_seq_lens_q, scaling, dropout, max_length_q, sliding_window=sliding_window, sinks=s_aux)
    return heads_to_seq(output, sp_group)[None], None


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


def grouped_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention signature over a padded batch: q (B, H, Q, D), k (B, Hkv, K, D), v (B, Hkv, K, Dv) and
    eager's additive (B, 1, Q, K) mask (a sliding window's included) -> ((B, Q, H, Dv), weights). Query head h reads
    KV head h // (H / Hkv), as transformers' repeat_kv pairs them; sinks `s_aux` as gpt-oss's eager attention."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scores = torch.matmul(query.reshape(batch, kv_heads, groups * queries, dim), key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores.view(batch, kv_heads, groups, queries, keys) + attention_mask[:, :, None, :, :keys]
    scores = scores.view(batch, kv_heads, groups * queries, keys)
    if s_aux is None:
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink_column = s_aux.reshape(1, kv_heads, groups, 1, 1).expand(batch, -1, -1, queries, 1).reshape(batch, kv_heads, groups * queries, 1)
        combined = torch.cat([scores, sink_column.to(scores.dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = F.softmax(combined, dim=-1, dtype=torch.float32).to(query.dtype)[..., :-1]
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).view(batch, heads, queries, value.shape[-1])
    return output.transpose(1, 2).contiguous(), weights.view(batch, heads, queries, keys)


AttentionInterface.register(GROUPED_ATTENTION, grouped_attention_forward)
AttentionMaskInterface.register(GROUPED_ATTENTION, eager_mask)
