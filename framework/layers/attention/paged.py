"""Paged KV-cache store and attention, reference implementations (plain PyTorch, any device).

A layer's cache is one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V). Queries of
row r are its `query_start_loc[r]:query_start_loc[r+1]` tokens at positions `seq_len - query_len ..
seq_len - 1`; each attends causally to every cached position up to its own (a varlen prefill reading any
cached prefix, or a decode step, are the same code).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from framework.layers.attention.metadata import AttentionMetadata
from framework.layers.kernels.kv_cache_dtype import saturating_cast


def store_kv_reference(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], updated in place
    kv_slot_mapping: torch.Tensor,  # [T] int64, negative = padding (skipped)
) -> None:
    """Write each token's K and V at its KV slot (cast to the cache's dtype, saturating when it is FP8). The cache
    may be a strided view (a layer's part of wider token rows: framework/models/gemma4.py)."""
    keep = kv_slot_mapping >= 0
    slots = kv_slot_mapping[keep]
    blocks, offsets = slots // kv_cache.shape[2], slots % kv_cache.shape[2]
    kv_cache[0, blocks, offsets] = saturating_cast(key[: kv_slot_mapping.numel()][keep], kv_cache.dtype)
    kv_cache[1, blocks, offsets] = saturating_cast(value[: kv_slot_mapping.numel()][keep], kv_cache.dtype)


def paged_attention_reference(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,  # > 0: a query at position p sees keys p - window + 1 .. p only
    sinks: Optional[torch.Tensor] = None,  # [num_heads] float32: a logit per head added to each denominator
) -> torch.Tensor:
    """[T, num_heads, head_dim]: causal attention of each row's queries over its cached keys (GQA aware).

    With `window`, only the keys some query of the row still sees are gathered (blocks of the table before
    them are never read: their memory may have gone to other requests). With `sinks`, the softmax of head h
    runs over the scores plus one more logit `sinks[h]` whose value vector is zero (gpt-oss's attention sinks).
    Loops over batch rows on the host: this is the reference, not the fast path.
    """
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for row in range(meta.num_rows):
        q_start, q_end, seq_len = starts[row], starts[row + 1], seq_lens[row]
        if q_end == q_start:
            continue
        first_q = seq_len - (q_end - q_start)
        kv_lo = max(first_q - window + 1, 0) if window > 0 else 0
        pos = torch.arange(kv_lo, seq_len, device=query.device)
        blocks, offsets = meta.block_tables[row, pos // block_size].long(), pos % block_size
        k = kv_cache[0, blocks, offsets]  # [S, kvH, D] (the cache may be a strided view)
        v = kv_cache[1, blocks, offsets]
        q = query[q_start:q_end]  # [Q, H, D]
        q_pos = torch.arange(first_q, seq_len, device=query.device)
        mask = pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [Q, S]
        if window > 0:
            mask &= pos.unsqueeze(0) > q_pos.unsqueeze(1) - window
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)
        if sinks is None:
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        else:
            o = _attention_with_sinks(q.transpose(0, 1), k, v, mask, scale, sinks)
        out[q_start:q_end] = o.transpose(0, 1)
    return out


def _attention_with_sinks(
    q: torch.Tensor,  # [H, Q, D]
    k: torch.Tensor,  # [H, S, D]
    v: torch.Tensor,  # [H, S, D]
    mask: torch.Tensor,  # [Q, S] bool, True = visible
    scale: float,
    sinks: torch.Tensor,  # [H]
) -> torch.Tensor:  # [H, Q, D]
    """Softmax over [scores, sink] in float32, the sink's column dropped before the product with V."""
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale  # [H, Q, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink_col = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)
