"""q/k norm + RoPE + KV store fused into the small-row paged-attention launch (decode, draft verification).

Semantics are `qk_norm_rope_store_reference` (framework/kernels/layer_ops.py) followed by
`paged_attention_reference` (framework/attention/paged.py), for batches whose rows all have at most
`BLOCK_Q` tokens: the two launches `qk_norm_rope_store_triton` + `_paged_attention_kernel` become one.

Program `(row, kv_head, split)` is the small-row program of `_paged_attention_kernel` (same tiles, same KV
splits, same in-kernel merge) that reads the raw merged projection `qkv [T, (H + 2 Hkv) D]` instead of q:

1. it stores the K (normed + roped) and raw V of the row's new tokens whose positions lie in its KV split,
   for its KV head (so each new (position, KV head) is stored by exactly one program; for decode that is
   the last non-empty split), then a CTA barrier makes them visible to all its threads;
2. it norms + ropes its GQA group's query heads of the row's tokens itself (every split recomputes them:
   a few hundred FLOPs, cheaper than a launch);
3. it attends over `[kv_lo, kv_hi)`, which holds the positions it stored and none another program stores.

The rounding points of the unfused kernel are kept (`_rms_norm_halves`, `_rope_halves`); only the norm's
summation order may differ. Padding tokens (KV slot < 0) store nothing. A token's K/V go to its KV slot while
the tile loop reads the position through the block table: they agree in every batch the runner builds
(a row's new positions lie in its own, unshared blocks), which the unfused path does not need to assume.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.attention.launch_config import AttentionTiles, decode_tiles, num_kv_splits, num_sms
from framework.attention.metadata import AttentionMetadata
from framework.attention.triton_paged_attention import merge_splits_apart, split_buffers
from framework.attention.triton_tiles import LOG2E, _attend_kv_range, _kv_tile_offsets, _split_len, _write_result
from framework.kernels.pdl import pdl_launch_kwargs
from framework.kernels.triton_qk_norm_rope import _rms_norm_halves, _rope_halves


@triton.jit
def _store_new_kv(
    qkv_ptr, cos_ptr, sin_ptr, k_weight_ptr, cache_ptr, kv_slot_ptr,
    q_start, q_len, context_len, kv_lo, kv_hi, kv_head, num_kv_tokens, eps,
    stride_qkv, stride_cos, stride_sin, stride_c_kv, stride_c_tok, stride_c_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_KQ: tl.constexpr, HAS_K_NORM: tl.constexpr,
):
    """Normed + roped K and raw V of the row's new tokens at positions in `[kv_lo, kv_hi)`, one KV head."""
    half = tl.arange(0, HALF)
    dtype = qkv_ptr.dtype.element_ty
    q_local = tl.arange(0, BLOCK_KQ)
    pos = context_len + q_local
    token = (q_start + q_local).to(tl.int64)
    in_split = (q_local < q_len) & (pos >= kv_lo) & (pos < kv_hi) & (token < num_kv_tokens)
    kv_slot = tl.load(kv_slot_ptr + token, mask=in_split, other=-1).to(tl.int64)
    store = in_split & (kv_slot >= 0)  # padding tokens store nothing
    src = qkv_ptr + token[:, None] * stride_qkv + (NUM_HEADS + kv_head) * HEAD_DIM + half[None, :]
    x1 = tl.load(src, mask=store[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=store[:, None], other=0.0).to(tl.float32)
    cos = cos_ptr + token[:, None] * stride_cos + half[None, :]
    sin = sin_ptr + token[:, None] * stride_sin + half[None, :]
    c1 = tl.load(cos, mask=store[:, None], other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF, mask=store[:, None], other=0.0).to(tl.float32)
    s1 = tl.load(sin, mask=store[:, None], other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF, mask=store[:, None], other=0.0).to(tl.float32)
    if HAS_K_NORM:
        x1, x2 = _rms_norm_halves(x1, x2, k_weight_ptr, half, half < HALF, eps, HALF, HEAD_DIM, dtype)
    k1, k2 = _rope_halves(x1, x2, c1, c2, s1, s2, dtype)
    # The cache viewed as [2, num_blocks * PAGE, Hkv, D] (the wrapper checks the strides): a KV slot is a row.
    dst = cache_ptr + kv_slot[:, None] * stride_c_tok + kv_head * stride_c_head + half[None, :]
    cache_dtype = cache_ptr.dtype.element_ty
    tl.store(dst, k1.to(cache_dtype), mask=store[:, None])
    tl.store(dst + HALF, k2.to(cache_dtype), mask=store[:, None])
    v_src = src + NUM_KV_HEADS * HEAD_DIM  # v head j sits Hkv heads after k head j
    v1 = tl.load(v_src, mask=store[:, None])
    v2 = tl.load(v_src + HALF, mask=store[:, None])
    tl.store(dst + stride_c_kv, v1.to(cache_dtype), mask=store[:, None])
    tl.store(dst + stride_c_kv + HALF, v2.to(cache_dtype), mask=store[:, None])


@triton.jit
def _rope_query_tile(
    qkv_ptr, cos_ptr, sin_ptr, q_weight_ptr, token, head, row_valid, eps,
    stride_qkv, stride_cos, stride_sin,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, HAS_Q_NORM: tl.constexpr,
):
    """[BLOCK_M, HEAD_DIM] qkv.dtype: matrix row i = query head `head[i]` of token `token[i]`, normed + roped.
    Computed as two halves (RoPE pairs element j with j + D/2) and joined for the dot products."""
    half = tl.arange(0, HALF)
    dtype = qkv_ptr.dtype.element_ty
    src = qkv_ptr + token[:, None] * stride_qkv + head[:, None] * HEAD_DIM + half[None, :]
    x1 = tl.load(src, mask=row_valid[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=row_valid[:, None], other=0.0).to(tl.float32)
    cos = cos_ptr + token[:, None] * stride_cos + half[None, :]
    sin = sin_ptr + token[:, None] * stride_sin + half[None, :]
    c1 = tl.load(cos, mask=row_valid[:, None], other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF, mask=row_valid[:, None], other=0.0).to(tl.float32)
    s1 = tl.load(sin, mask=row_valid[:, None], other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF, mask=row_valid[:, None], other=0.0).to(tl.float32)
    if HAS_Q_NORM:
        x1, x2 = _rms_norm_halves(x1, x2, q_weight_ptr, half, half < HALF, eps, HALF, HEAD_DIM, dtype)
    q1, q2 = _rope_halves(x1, x2, c1, c2, s1, s2, dtype)
    # join -> [BLOCK_M, HALF, 2]; permute -> [BLOCK_M, 2, HALF]; reshape: q1 then q2 along each row.
    return tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_M, HEAD_DIM))


@triton.jit(do_not_specialize=["num_splits", "num_kv_tokens"])  # per-step sizes: no recompiles mid-run
def _rope_paged_attention_kernel(
    qkv_ptr,  # [T, (H + 2 Hkv) * D], row stride stride_qkv: q heads, then k heads, then v heads
    cos_ptr,  # [T, D], row stride stride_cos
    sin_ptr,  # [T, D], row stride stride_sin
    q_weight_ptr,  # [D] (qkv_ptr again when HAS_Q_NORM is False; not read)
    k_weight_ptr,  # [D] (qkv_ptr again when HAS_K_NORM is False; not read)
    cache_ptr,  # [2, num_blocks, PAGE, Hkv, D], updated in place (this step's K/V)
    out_ptr,  # [T, H, D]
    part_o_ptr,  # [R, Hkv, num_splits, BLOCK_M, D] float32 (IS_SPLIT only)
    part_lse_ptr,  # [R, Hkv, num_splits, BLOCK_M] float32, log2 domain (IS_SPLIT only)
    query_start_loc_ptr,  # [R+1] int32
    seq_lens_ptr,  # [R] int32
    block_tables_ptr,  # [R, max_blocks] int32
    kv_slot_ptr,  # [T'] int64: KV slot of token t < T', negative = padding
    split_counters_ptr,  # [>= R * Hkv] int32, zero on entry and left zero (FUSED_REDUCE only)
    num_kv_tokens, num_splits, qk_scale, eps,
    stride_qkv, stride_cos, stride_sin, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
    stride_bt_row,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # HEAD_DIM // 2
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # matrix rows of a query tile (>= BLOCK_Q * GROUP)
    BLOCK_Q: tl.constexpr,  # tokens a row may have
    BLOCK_KQ: tl.constexpr,  # next power of two >= BLOCK_Q (the new-K tile)
    BLOCK_N: tl.constexpr,  # keys of a KV tile
    PAGE: tl.constexpr,  # tokens per KV-cache block
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    IS_SPLIT: tl.constexpr,  # write partial results per KV split (axis 2)
    DOT_IEEE: tl.constexpr,  # float32 inputs: exact products instead of tf32
    FUSED_REDUCE: tl.constexpr = False,  # IS_SPLIT: the last split program of a (row, KV head) merges them
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (framework/kernels/pdl.py)
):
    if USE_PDL:  # qkv, cos / sin, the KV cache and the metadata are all written by earlier kernels
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if (q_len == 0) | (q_len > BLOCK_Q):
        return  # the wrapper launches only when every row fits: nothing of this row is stored elsewhere
    seq_len = tl.load(seq_lens_ptr + row)
    context_len = seq_len - q_len  # keys cached before this step's first query
    kv_lo = 0
    kv_hi = seq_len
    split_len = seq_len
    if IS_SPLIT:
        split_len = _split_len(seq_len, num_splits, BLOCK_N)
        kv_lo = split * split_len
        if kv_lo >= seq_len:
            return  # empty split of a short row: holds no new position either
        kv_hi = tl.minimum(seq_len, kv_lo + split_len)

    # 1. This split's new keys / values, before its tile loop reads them.
    if context_len < kv_hi:  # some new position in this split: always unsplit; for decode, the last split only
        _store_new_kv(qkv_ptr, cos_ptr, sin_ptr, k_weight_ptr, cache_ptr, kv_slot_ptr,
                      q_start, q_len, context_len, kv_lo, kv_hi, kv_head, num_kv_tokens, eps,
                      stride_qkv, stride_cos, stride_sin, stride_c_kv, stride_c_tok, stride_c_head,
                      NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HALF, BLOCK_KQ, HAS_K_NORM)
        # One thread's stores, other threads' tile loads: the barrier orders them within the CTA.
        tl.debug_barrier()

    # 2. The query tile: matrix row i is token i // GROUP, query head kv_head * GROUP + i % GROUP.
    m_rows = tl.arange(0, BLOCK_M)
    q_local = m_rows // GROUP
    head = kv_head * GROUP + m_rows % GROUP
    row_valid = (m_rows < BLOCK_Q * GROUP) & (q_local < q_len)
    token = (q_start + q_local).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = _rope_query_tile(qkv_ptr, cos_ptr, sin_ptr, q_weight_ptr, token, head, row_valid, eps,
                         stride_qkv, stride_cos, stride_sin, HEAD_DIM, HALF, BLOCK_M, HAS_Q_NORM)
    q_pos = tl.minimum(context_len + q_local, seq_len - 1)  # invalid rows clamped; never stored

    # 3. Attention over [kv_lo, kv_hi), as `_paged_attention_kernel`'s small rows.
    full_hi = (context_len + 1) // BLOCK_N * BLOCK_N  # keys every query of the row sees: no mask
    mid = tl.maximum(kv_lo, tl.minimum(kv_hi, full_hi))
    tile_pages, k_offsets, v_offsets = _kv_tile_offsets(kv_head, dims, stride_c_tok, stride_c_head, BLOCK_N, PAGE)
    bt_row_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt_row
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked tiles give p = 0, not NaN
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q, kv_lo, mid, kv_hi, q_pos, cache_ptr, bt_row_ptr, k_offsets, v_offsets, tile_pages,
        stride_c_kv, stride_c_blk, stride_c_tok, qk_scale, BLOCK_N, PAGE, DOT_IEEE, False)
    _write_result(acc, l_i, m_i, out_ptr, part_o_ptr, part_lse_ptr, split_counters_ptr,
                  row, kv_head, NUM_KV_HEADS, split, num_splits, seq_len, split_len, token, head, m_rows,
                  row_valid, dims, stride_ot, stride_oh, HEAD_DIM, BLOCK_M, IS_SPLIT, FUSED_REDUCE)


def rope_paged_attention(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D] bf16/fp16/fp32, last dim contiguous: q, k, v heads
    cos: torch.Tensor,  # [T, D] qkv.dtype, last dim contiguous (cat([freqs, freqs]).cos())
    sin: torch.Tensor,  # [T, D] qkv.dtype, last dim contiguous
    q_norm_weight: Optional[torch.Tensor],  # [D] qkv.dtype, or None: no q norm (Llama)
    k_norm_weight: Optional[torch.Tensor],  # [D] qkv.dtype, or None: no k norm
    eps: float,
    num_heads: int,  # H
    num_kv_heads: int,  # Hkv
    head_dim: int,  # D: a power of two in 16..256
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], updated in place
    meta: AttentionMetadata,  # query_start_loc [R+1], seq_lens [R], block_tables [R, max_blocks] int32;
    # kv_slot_mapping [T'] int64 (T' <= T, negative = padding); every row at most
    # `launch_config.small_query_len` tokens (`meta.max_query_len`)
    scale: float,
    *,
    num_splits: Optional[int] = None,  # override the split rule (tests)
    small_tiles: Optional[AttentionTiles] = None,  # override the tile config (tests, benchmarks)
    pdl: bool = False,  # programmatic dependent launch (only where framework.kernels.pdl.pdl_supported)
    split_counters: Optional[torch.Tensor] = None,  # [>= R * Hkv] int32 on qkv's device, all zero
    fused_reduce: bool = True,  # False: merge KV splits in a second launch
) -> torch.Tensor:
    """[T, H, D]: `qk_norm_rope_store` then `paged_attention` in one launch (the K/V of the first T' tokens go
    to the cache as there). Tokens past `query_start_loc[R]` are neither stored nor written. No host sync:
    the grid comes from `meta.num_rows`, `meta.max_seq_len` and the shapes; tiles and KV splits are
    `paged_attention`'s for the same all-small batch."""
    num_tokens = qkv.shape[0]
    _, _, block_size, cache_heads, cache_dim = kv_cache.shape
    assert (cache_heads, cache_dim) == (num_kv_heads, head_dim), "cache heads / head_dim differ from the model's"
    assert head_dim in (16, 32, 64, 128, 256), f"fused RoPE attention needs head_dim in 16..256, got {head_dim}"
    assert block_size & (block_size - 1) == 0, f"KV block_size must be a power of two, got {block_size}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly"
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1, "bad qkv layout"
    assert cos.shape == (num_tokens, head_dim) and sin.shape == cos.shape, "cos/sin must be [T, head_dim]"
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.dtype == qkv.dtype and sin.dtype == qkv.dtype
    for weight in (q_norm_weight, k_norm_weight):
        assert weight is None or (weight.shape == (head_dim,) and weight.stride(0) == 1 and weight.dtype == qkv.dtype)
    # A KV slot indexes blocks and offsets together, which needs the two axes to be one uniform stride.
    assert kv_cache.stride(1) == block_size * kv_cache.stride(2) and kv_cache.stride(4) == 1, "bad cache layout"
    assert meta.kv_slot_mapping.numel() <= num_tokens, "more KV slots than tokens"
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    num_rows = meta.num_rows
    if num_rows == 0 or num_tokens == 0:
        return out
    on_gpu = qkv.device.type == "cuda"
    sms = num_sms(qkv.device)
    # The tiles and splits `paged_attention` picks for an all-small batch (see there why they follow its shape).
    small = small_tiles or decode_tiles(head_dim, group, on_gpu, qkv.element_size(),
                                        num_programs=num_rows * num_kv_heads, max_seq_len=meta.max_seq_len,
                                        num_sms=sms)
    small_q = small.block_m // group
    assert meta.max_query_len <= small_q, f"rows of up to {small_q} tokens only, got {meta.max_query_len}"
    if num_splits is None:
        num_splits = num_kv_splits(num_rows, num_kv_heads, meta.max_seq_len, sms, small.block_n)
    bufs = split_buffers(out, meta, num_kv_heads, num_splits, small.block_m, fused_reduce, split_counters)
    _rope_paged_attention_kernel[(num_rows, num_kv_heads, num_splits)](
        qkv, cos, sin,
        q_norm_weight if q_norm_weight is not None else qkv,
        k_norm_weight if k_norm_weight is not None else qkv,
        kv_cache, out, bufs.part_o, bufs.part_lse,
        meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.kv_slot_mapping,
        bufs.counters,  # read only by a fused merge
        meta.kv_slot_mapping.numel(), num_splits, scale * LOG2E, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        meta.block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2, GROUP=group,
        BLOCK_M=small.block_m, BLOCK_Q=small_q, BLOCK_KQ=triton.next_power_of_2(small_q),
        BLOCK_N=small.block_n, PAGE=block_size,
        HAS_Q_NORM=q_norm_weight is not None, HAS_K_NORM=k_norm_weight is not None,
        IS_SPLIT=num_splits > 1, DOT_IEEE=qkv.dtype == torch.float32, FUSED_REDUCE=bufs.fused,
        num_warps=small.num_warps, num_stages=small.num_stages, **pdl_launch_kwargs(pdl),
    )
    merge_splits_apart(out, bufs, meta, num_kv_heads, num_splits, group, small, pdl)
    return out
