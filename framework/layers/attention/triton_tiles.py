"""The Triton building blocks of the paged-attention kernels (`triton_paged_attention`, `triton_prefill_attention`):
a KV tile's addresses and block ids, the online-softmax fold of one tile and of a range of tiles, KV splits and
their merge, and the end of a program (its output, or its split's partial and, in the fused reduce, the merge by
the last split to finish). All `@triton.jit` helpers, inlined into the kernels that call them; their semantics
and grids are described in those kernels' modules and in docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.kv_cache_dtype import is_fp8

LOG2E = 1.4426950408889634


@triton.jit
def _kv_tile_offsets(kv_head, dims, stride_c_tok, stride_c_head, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Loop-invariant address parts of one KV head's tiles (cache last dim contiguous; tiles start at multiples
    of BLOCK_N, so only the tile's physical blocks change): (tile_pages [BLOCK_N]: each key's page within the
    tile, k_offsets [HEAD_DIM, BLOCK_N]: K loaded transposed, v_offsets [BLOCK_N, HEAD_DIM])."""
    n_offs = tl.arange(0, BLOCK_N)
    if PAGE >= BLOCK_N:
        tile_pages = n_offs * 0
        tok_offs = n_offs * stride_c_tok
    else:
        tile_pages = n_offs // PAGE
        tok_offs = (n_offs % PAGE) * stride_c_tok
    tok_offs = tok_offs + kv_head * stride_c_head
    return tile_pages, dims[:, None] + tok_offs[None, :], tok_offs[:, None] + dims[None, :]


@triton.jit
def _find_row(query_start_loc_ptr, num_rows, tile, BLOCK_Q: tl.constexpr):
    """Batch row owning query tile `tile`: row r's tiles start at `query_start_loc[r] // BLOCK_Q + r`."""
    lo = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= tile
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


def products_in_f16(cache_dtype: torch.dtype, query_dtype: torch.dtype) -> bool:
    """Whether attention of a bfloat16 query over a cache of `cache_dtype` multiplies in float16 (`DOT_F16`): for
    FP8 caches. Two FP8 elements become float16 in one instruction (`cvt.rn.f16x2.e4m3x2`), bfloat16 only through
    float16, one more per element (Triton's PTX for sm_90); decode attention measured 1.2-1.3x faster at 16-256
    rows with float16 products (benchmarks/bench_attention.py --sweep-kv-dtype), and float16 holds FP8 exactly;
    q keeps more mantissa in float16 than in bfloat16, and so does P (in [0, 1]). Only a |q| past float16's
    65,504 changes (saturated). float16 queries multiply in float16 anyway, float32 ones stay float32."""
    return is_fp8(cache_dtype) and query_dtype == torch.bfloat16


@triton.jit
def to_f16_saturated(x):
    """`x` as float16, magnitudes past its largest finite value (65,504) saturated instead of infinite."""
    return tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per KV split of a row: an equal share of seq_len, rounded up to whole KV tiles."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _window_start(first_q_pos, window, BLOCK_N: tl.constexpr):
    """First key of the first KV tile a query tile starting at `first_q_pos` reads under a sliding window of
    `window` keys (a query at p sees keys p - window + 1 .. p): tiles wholly before it are skipped."""
    return tl.maximum(first_q_pos - window + 1, 0) // BLOCK_N * BLOCK_N


@triton.jit
def _unmasked_start(last_q_pos, window, kv_lo, mid, BLOCK_N: tl.constexpr):
    """First key of the first tile inside every query's window (queries up to `last_q_pos`), in [kv_lo, mid]:
    the tiles before it need the window mask."""
    inside = tl.cdiv(tl.maximum(last_q_pos - window + 1, 0), BLOCK_N) * BLOCK_N
    return tl.minimum(tl.maximum(inside, kv_lo), mid)


@triton.jit
def _tile_block_ids(
    bt_row_ptr, start, kv_hi, tile_pages, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr
):
    """Physical block(s) of KV tile `[start, start + BLOCK_N)`, `start < kv_hi`: one id when a page holds the
    tile, else one per key (`tile_pages` = key // PAGE); MASKED: keys at or past `kv_hi` read id 0 (never
    dereferenced unmasked)."""
    if PAGE >= BLOCK_N:  # the tile lies inside one page
        return tl.load(bt_row_ptr + start // PAGE)
    else:  # the tile spans BLOCK_N // PAGE pages
        if MASKED:
            kv_valid = start + tl.arange(0, BLOCK_N) < kv_hi
            return tl.load(bt_row_ptr + start // PAGE + tile_pages, mask=kv_valid, other=0)
        else:
            return tl.load(bt_row_ptr + start // PAGE + tile_pages)


@triton.jit
def _attend_kv_tile(
    acc,
    l_i,
    m_i,
    q,
    start,
    kv_hi,
    q_pos,
    cache_ptr,
    bt_row_ptr,
    k_offsets,
    v_offsets,
    tile_pages,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    qk_scale,
    window,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One KV tile `[start, start + BLOCK_N)` folded into the running softmax state (acc, l_i, m_i); MASKED
    tiles hide keys past each query (and, HAS_WINDOW, keys `window` or more positions before it)."""
    block = _tile_block_ids(bt_row_ptr, start, kv_hi, tile_pages, BLOCK_N, PAGE, MASKED)
    kv_pos = start + tl.arange(0, BLOCK_N)
    kv_valid = kv_pos < kv_hi
    # Tiles start at multiples of BLOCK_N, so the in-page part of each address is loop-invariant
    # (k_offsets / v_offsets); only the physical block of the tile's pages changes.
    if PAGE >= BLOCK_N:
        base = block.to(tl.int64) * stride_c_blk + (start % PAGE) * stride_c_tok
        k_ptrs = cache_ptr + base + k_offsets
        v_ptrs = cache_ptr + stride_c_kv + base + v_offsets
    else:
        block_off = block.to(tl.int64) * stride_c_blk
        k_ptrs = cache_ptr + block_off[None, :] + k_offsets
        v_ptrs = cache_ptr + stride_c_kv + block_off[:, None] + v_offsets
    if MASKED:
        k = tl.load(k_ptrs, mask=kv_valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=kv_valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    if DOT_IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        if HAS_WINDOW:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


@triton.jit
def _merge_kv_splits(
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    first_part,
    used_splits,
    token,
    head,
    m_rows,
    row_valid,
    dims,
    stride_ot,
    stride_oh,
    sink,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Merge one (row, KV head)'s partials into `out`: the fused path's last split program and the two-launch
    path's `_split_kv_reduce_kernel` both call this, so they agree bit for bit. Loads bypass L1 (`.cg`):
    partials of other programs, published through the counter's acquire (or the end of the previous launch).
    HAS_SINKS: `sink` [BLOCK_M] (log2 domain) joins as one more split whose output is zero, so the weights
    sum to the softmax denominator with the sink's logit in it."""
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if HAS_SINKS:
        weight = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        m_run = sink
    else:
        weight = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_run = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    # MERGE_UNROLL splits per iteration, unrolled, so their loads are in flight together (a rolled loop waited
    # one L2 round trip per split: ~1-2 us of a batch-1 layer, 1e476a2:scripts/bench_pdl.py --ablate). A split past
    # `used_splits` reads lse -inf and o 0, so alpha 1 and beta 0: an identity, the same result bit for bit.
    for split0 in range(0, used_splits, MERGE_UNROLL):
        for j in tl.static_range(MERGE_UNROLL):
            live = row_valid & (m_rows * 0 + split0 + j < used_splits)  # [BLOCK_M]
            part = first_part + split0 + j
            lse = tl.load(part_lse_ptr + part * BLOCK_M + m_rows, mask=live, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(
                part_o_ptr + part * BLOCK_M * HEAD_DIM + m_rows[:, None] * HEAD_DIM + dims[None, :],
                mask=live[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m_run, lse)
            alpha = tl.exp2(m_run - m_new)
            beta = tl.exp2(lse - m_new)
            acc = acc * alpha[:, None] + o * beta[:, None]
            weight = weight * alpha + beta
            m_run = m_new
    out = acc / tl.where(weight > 0.0, weight, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


@triton.jit
def _attend_kv_range(
    acc,
    l_i,
    m_i,
    q,
    kv_lo,
    lo_unmasked,
    mid,
    kv_hi,
    q_pos,
    cache_ptr,
    bt_row_ptr,
    k_offsets,
    v_offsets,
    tile_pages,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    qk_scale,
    window,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Keys `[kv_lo, kv_hi)` folded into the softmax state: unmasked tiles `[lo_unmasked, mid)` (every query of
    the tile sees them), masked ones before (HAS_WINDOW: the window's lower edge) and after (the diagonal)."""
    if HAS_WINDOW:
        for start in range(kv_lo, lo_unmasked, BLOCK_N):
            acc, l_i, m_i = _attend_kv_tile(
                acc,
                l_i,
                m_i,
                q,
                start,
                kv_hi,
                q_pos,
                cache_ptr,
                bt_row_ptr,
                k_offsets,
                v_offsets,
                tile_pages,
                stride_c_kv,
                stride_c_blk,
                stride_c_tok,
                qk_scale,
                window,
                BLOCK_N,
                PAGE,
                True,
                DOT_IEEE,
                HAS_WINDOW,
            )
    for start in range(lo_unmasked, mid, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(
            acc,
            l_i,
            m_i,
            q,
            start,
            kv_hi,
            q_pos,
            cache_ptr,
            bt_row_ptr,
            k_offsets,
            v_offsets,
            tile_pages,
            stride_c_kv,
            stride_c_blk,
            stride_c_tok,
            qk_scale,
            window,
            BLOCK_N,
            PAGE,
            False,
            DOT_IEEE,
            HAS_WINDOW,
        )
    for start in range(mid, kv_hi, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(
            acc,
            l_i,
            m_i,
            q,
            start,
            kv_hi,
            q_pos,
            cache_ptr,
            bt_row_ptr,
            k_offsets,
            v_offsets,
            tile_pages,
            stride_c_kv,
            stride_c_blk,
            stride_c_tok,
            qk_scale,
            window,
            BLOCK_N,
            PAGE,
            True,
            DOT_IEEE,
            HAS_WINDOW,
        )
    return acc, l_i, m_i


@triton.jit
def _write_result(
    acc,
    l_i,
    m_i,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    split_counters_ptr,
    row,
    kv_head,
    num_kv_heads,
    split,
    num_splits,
    seq_len,
    split_len,
    token,
    head,
    m_rows,
    row_valid,
    dims,
    stride_ot,
    stride_oh,
    sink,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """The end of a program: its output rows, or (IS_SPLIT, small rows) its split's partial result and
    log-sum-exp; with FUSED_REDUCE the last of the row's non-empty splits to finish then merges them all.
    `seq_len` is the length the splits divide (keys from the row's first readable tile on). HAS_SINKS: `sink`
    [BLOCK_M] (log2 domain) adds its term to the denominator, here or in the merge of the splits."""
    has_keys = l_i > 0.0  # a split may hold no key visible to an early query of a draft-verify row
    if HAS_SINKS and not IS_SPLIT:
        l_i = l_i + tl.exp2(sink - m_i)
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if IS_SPLIT:
        part = (row.to(tl.int64) * num_kv_heads + kv_head) * num_splits + split
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part * BLOCK_M + m_rows, lse, mask=row_valid)
        tl.store(
            part_o_ptr + part * BLOCK_M * HEAD_DIM + m_rows[:, None] * HEAD_DIM + dims[None, :],
            o,
            mask=row_valid[:, None],
        )
        if FUSED_REDUCE:
            # Empty splits returned early without counting: the last of the row's non-empty splits merges.
            used_splits = tl.cdiv(seq_len, split_len)
            counter = split_counters_ptr + row * num_kv_heads + kv_head
            # Every thread's partial stores before the counter: the barrier orders them before the one thread
            # that increments it, whose release publishes them to the merging program (its acquire).
            tl.debug_barrier()
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == used_splits - 1:
                _merge_kv_splits(
                    out_ptr,
                    part_o_ptr,
                    part_lse_ptr,
                    part - split,
                    used_splits,
                    token,
                    head,
                    m_rows,
                    row_valid,
                    dims,
                    stride_ot,
                    stride_oh,
                    sink,
                    HEAD_DIM,
                    BLOCK_M,
                    MERGE_UNROLL,
                    HAS_SINKS,
                )
                tl.store(counter, 0)  # every split has counted: the next launch (graph replay) starts at 0
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )
