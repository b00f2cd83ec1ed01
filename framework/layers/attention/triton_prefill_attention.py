"""Prefill (large-row) paged attention in Triton: a FlashAttention-style kernel with switchable variants.

Same semantics as `paged_attention_reference` (framework/layers/attention/paged.py) for the rows it serves: rows
with `query_len > skip_query_len` (prefill chunks); shorter rows are left to the decode launch of
`triton_paged_attention.paged_attention`, which calls `prefill_attention` for its large rows (its argument
`prefill_kernel=False` runs the older large-row launch of `_paged_attention_kernel` instead, for comparisons).

A program owns one query tile (`BLOCK_Q` tokens of one row x `HEADS` query heads of one GQA group, flattened
into `BLOCK_M` matrix rows) and walks its keys in `BLOCK_N` tiles gathered through the block table; fully
visible tiles run unmasked, the causal diagonal masked. Against the older launch it differs in the ways FA2/3
kernels on Hopper do, each behind a `PrefillVariant` field so an H200 sweep can pick
(`1e476a2:scripts/bench_prefill_attention.py`):

* `prefetch_pages`: the next tile's block ids are loaded a tile ahead, so Triton's pipeliner keeps a K/V
  tile in flight during a tile's MMAs (with the id lookup inside the tile it gives K/V 2 buffers and waits
  for the copy just issued: docs/kernels.md "Prefill attention");
* `P @ V` accumulates into the rescaled accumulator (`tl.dot(p, v, acc)`): no second fp32 tile in registers;
* the softmax scale is one FMA on the raw scores (or folded into Q once: `q_prescale`);
* `reverse`: grid `(head blocks, tiles)` walked last tile first, so the longest (causal) tiles start first
  and the short ones fill the tail of the last wave;
* `k_trans`: K gathered as `[HEAD_DIM, BLOCK_N]` (as before) or as `[BLOCK_N, HEAD_DIM]` with the same
  address tensor as V, then `tl.trans` (fewer registers for addresses);
* `heads`: how many query heads of a group share a tile (the whole group: K/V loaded once per group; 1: one
  head per program, `BLOCK_M` tokens);
* `loop_stages` / `warp_spec`: `tl.range` software pipelining depth and automatic warp specialisation of the
  unmasked loop (the latter a no-op on Hopper with Triton 3.6: it specialises TMA loads only);
* `qk_ahead`: tile i+1's scores issued before tile i's softmax (FA3's intra-warpgroup overlap).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import triton
import triton.language as tl

from framework.layers.attention.launch_config import WIDE_PREFILL_TILES
from framework.layers.attention.metadata import AttentionMetadata
from framework.layers.attention.triton_tiles import (
    LOG2E,
    _find_row,
    _kv_tile_offsets,
    _unmasked_start,
    _window_start,
    products_in_f16,
    to_f16_saturated,
)
from framework.layers.kernels.launch_math import next_power_of_2


@dataclass(frozen=True)
class PrefillVariant:
    """Launch configuration and code variant of `_prefill_attention_kernel` (fixed, never autotuned)."""

    block_m: int = 128  # matrix rows of a query tile (tokens x heads), power of two
    block_n: int = 128  # keys of a KV tile, power of two
    num_warps: int = 8
    num_stages: int = 3
    heads: int = 0  # query heads per tile: 0 = the whole GQA group, else a divisor of it (1: one head)
    k_trans: bool = True  # gather K as [HEAD_DIM, BLOCK_N]; False: [BLOCK_N, HEAD_DIM] then tl.trans
    q_prescale: bool = False  # fold softmax scale (log2 domain) into Q once, before the loop
    reverse: bool = True  # longest tiles first: grid (head blocks, tiles), tile ids walked backwards
    loop_stages: int = 0  # tl.range(num_stages=...) of the unmasked loop; 0 = num_stages
    warp_spec: bool = False  # tl.range(warp_specialize=True) on the unmasked loop
    prefetch_pages: bool = True  # block ids of the next KV tile loaded one tile ahead (registers)
    qk_ahead: bool = False  # issue tile i+1's QK^T before tile i's softmax (FA3's intra-warpgroup overlap)

    @classmethod
    def parse(cls, text: str, base: PrefillVariant | None = None) -> PrefillVariant:
        """`"block_m=64,num_warps=4,reverse=0"` applied over `base` (default: the default variant)."""
        types = {f.name: f.type for f in fields(cls)}
        updates: dict[str, int | bool] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            if key not in types:
                raise ValueError(f"unknown PrefillVariant field {key!r} in {text!r}; fields: {sorted(types)}")
            updates[key] = value.lower() in ("1", "true", "yes") if types[key] in (bool, "bool") else int(value)
        return replace(base or cls(), **updates)

    def label(self) -> str:
        base = f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}"
        flags = [
            name
            for name, on in (
                ("rev", self.reverse),
                ("ktrans", self.k_trans),
                ("qscale", self.q_prescale),
                ("ws", self.warp_spec),
                ("pf", self.prefetch_pages),
                ("qka", self.qk_ahead),
            )
            if on
        ]
        extra = ([f"h{self.heads}"] if self.heads else []) + ([f"ls{self.loop_stages}"] if self.loop_stages else [])
        return "-".join([base, *flags, *extra])


def default_variant(head_dim: int, on_gpu: bool, elem_size: int = 2) -> PrefillVariant:
    """The variant `prefill_attention` runs unless given one (`PrefillVariant.parse` edits it for sweeps).

    Head_dim 128, from the H200 sweep of 2026-12-02 (`1e476a2:scripts/bench_prefill_attention.py`, docs/benchmarks.md):
    128x128 tiles, 8 warps, 3 stages, reversed order, block ids a tile ahead, K gathered as rows then
    `tl.trans` (`k_trans=False`): the best of 15 variants at all four shapes swept, 1.21-1.71x the older launch
    (causal 8,192 tokens: 459 against 317 TFLOP/s). Other head dims keep the older launch's tiles (unmeasured).
    """
    if not on_gpu:  # interpreter: small tiles so tests cross tile and page boundaries
        return PrefillVariant(32, 16, 4, 1)
    if head_dim > 256:  # 512-wide heads: launch_config.WIDE_PREFILL_TILES (fitted by compiling, unmeasured)
        wide = WIDE_PREFILL_TILES
        return PrefillVariant(wide.block_m, wide.block_n, wide.num_warps, wide.num_stages)
    if head_dim > 128 or elem_size > 2:  # 256-wide heads or float32: shared memory allows less
        return PrefillVariant(64, 32, 4, 2)
    if head_dim == 128:
        return PrefillVariant(128, 128, 8, 3, k_trans=False)
    return PrefillVariant(128, 64, 4, 3)


@triton.jit
def _tile_blocks(bt_row_ptr, start, kv_hi, tile_pages, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Physical blocks of KV tile `[start, start + BLOCK_N)`: one id, or one per key (pages past kv_hi: 0)."""
    if PAGE >= BLOCK_N:  # one page holds the whole tile: a scalar lookup
        return tl.load(bt_row_ptr + start // PAGE, mask=start < kv_hi, other=0)
    else:
        return tl.load(bt_row_ptr + start // PAGE + tile_pages, mask=start + tile_pages * PAGE < kv_hi, other=0)


@triton.jit
def _load_k(
    cache_ptr,
    blocks,
    start,
    kv_hi,
    k_offsets,
    stride_c_blk,
    stride_c_tok,
    q_dtype: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    K_TRANS: tl.constexpr,
):
    """[HEAD_DIM, BLOCK_N] keys of tile `[start, start + BLOCK_N)` on physical `blocks` (`_tile_blocks`)."""
    kv_valid = start + tl.arange(0, BLOCK_N) < kv_hi
    # Only the physical blocks change from tile to tile; the in-page offsets are loop-invariant.
    if PAGE >= BLOCK_N:
        k_ptrs = cache_ptr + blocks.to(tl.int64) * stride_c_blk + (start % PAGE) * stride_c_tok + k_offsets
    elif K_TRANS:
        k_ptrs = cache_ptr + (blocks.to(tl.int64) * stride_c_blk)[None, :] + k_offsets
    else:
        k_ptrs = cache_ptr + (blocks.to(tl.int64) * stride_c_blk)[:, None] + k_offsets
    if MASKED and K_TRANS:
        k = tl.load(k_ptrs, mask=kv_valid[None, :], other=0.0)
    elif MASKED:
        k = tl.load(k_ptrs, mask=kv_valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    k = k.to(q_dtype)
    if not K_TRANS:
        k = tl.trans(k)
    return k


@triton.jit
def _load_v(
    cache_ptr,
    blocks,
    start,
    kv_hi,
    v_offsets,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    q_dtype: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """[BLOCK_N, HEAD_DIM] values of tile `[start, start + BLOCK_N)` on physical `blocks`."""
    if PAGE >= BLOCK_N:
        v_ptrs = (
            cache_ptr + stride_c_kv + blocks.to(tl.int64) * stride_c_blk + (start % PAGE) * stride_c_tok + v_offsets
        )
    else:
        v_ptrs = cache_ptr + stride_c_kv + (blocks.to(tl.int64) * stride_c_blk)[:, None] + v_offsets
    if MASKED:
        v = tl.load(v_ptrs, mask=(start + tl.arange(0, BLOCK_N) < kv_hi)[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    return v.to(q_dtype)


@triton.jit
def _scores(q, k, DOT_IEEE: tl.constexpr):
    """[BLOCK_M, BLOCK_N] raw scores q @ k (already scaled with Q_PRESCALE)."""
    if DOT_IEEE:
        return tl.dot(q, k, input_precision="ieee")
    else:
        return tl.dot(q, k)


@triton.jit
def _softmax_pv(
    acc,
    l_i,
    m_i,
    s,
    v,
    start,
    kv_hi,
    q_pos,
    qk_scale,
    window,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    Q_PRESCALE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Scores `s` and values `v` of tile `[start, start + BLOCK_N)` folded into the online softmax state
    (acc, l_i, m_i; log2 domain). MASKED: keys past each query (HAS_WINDOW: and `window` or more before it)
    are hidden."""
    if MASKED:
        kv_pos = start + tl.arange(0, BLOCK_N)
        visible = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos < kv_hi)[None, :]
        if HAS_WINDOW:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    if Q_PRESCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:  # scale and subtract in one FMA per score
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DOT_IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _fold_kv_tile(
    acc,
    l_i,
    m_i,
    q,
    start,
    kv_hi,
    q_pos,
    blocks,
    cache_ptr,
    k_offsets,
    v_offsets,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    qk_scale,
    window,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    K_TRANS: tl.constexpr,
    Q_PRESCALE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """KV tile `[start, start + BLOCK_N)` on physical `blocks` folded into the online softmax state."""
    k = _load_k(
        cache_ptr, blocks, start, kv_hi, k_offsets, stride_c_blk, stride_c_tok, q.dtype, BLOCK_N, PAGE, MASKED, K_TRANS
    )
    v = _load_v(
        cache_ptr,
        blocks,
        start,
        kv_hi,
        v_offsets,
        stride_c_kv,
        stride_c_blk,
        stride_c_tok,
        q.dtype,
        BLOCK_N,
        PAGE,
        MASKED,
    )
    s = _scores(q, k, DOT_IEEE)
    return _softmax_pv(
        acc, l_i, m_i, s, v, start, kv_hi, q_pos, qk_scale, window, BLOCK_N, MASKED, DOT_IEEE, Q_PRESCALE, HAS_WINDOW
    )


@triton.jit(do_not_specialize=["num_rows", "num_tiles"])  # per-step sizes: no recompiles mid-run
def _prefill_attention_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM]
    cache_ptr,  # [2, num_blocks, PAGE, num_kv_heads, HEAD_DIM]
    out_ptr,  # [T, num_heads, HEAD_DIM]
    query_start_loc_ptr,  # [R+1] int32
    seq_lens_ptr,  # [R] int32
    block_tables_ptr,  # [R, max_blocks] int32
    sinks_ptr,  # [num_heads] float32: each head's sink logit (HAS_SINKS only)
    num_rows,
    num_tiles,
    qk_scale,
    window,  # keys a query sees, itself included (HAS_WINDOW only)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    stride_bt_row,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS: tl.constexpr,  # query heads per tile (a divisor of GROUP)
    BLOCK_M: tl.constexpr,  # matrix rows of a query tile (>= BLOCK_Q * HEADS)
    BLOCK_Q: tl.constexpr,  # tokens of a query tile
    BLOCK_N: tl.constexpr,  # keys of a KV tile
    PAGE: tl.constexpr,  # tokens per KV-cache block
    SKIP_QUERY_LEN: tl.constexpr,  # rows with query_len <= this belong to the decode launch
    DOT_IEEE: tl.constexpr,  # float32 inputs: exact products instead of tf32
    K_TRANS: tl.constexpr,
    Q_PRESCALE: tl.constexpr,
    REVERSE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
    QK_AHEAD: tl.constexpr,
    DOT_F16: tl.constexpr = False,  # products in float16 (FP8 caches: triton_tiles.products_in_f16)
    HAS_WINDOW: tl.constexpr = False,  # sliding window: KV tiles wholly before every query's window skipped
    HAS_SINKS: tl.constexpr = False,  # one learned logit per head in every softmax denominator
):
    if REVERSE:  # grid (head blocks, tiles): consecutive programs share a tile; the last (longest) tiles first
        head_block = tl.program_id(0)
        tile = num_tiles - 1 - tl.program_id(1)
    else:
        tile = tl.program_id(0)
        head_block = tl.program_id(1)
    row = _find_row(query_start_loc_ptr, num_rows, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    q_tile_start = (tile - q_start // BLOCK_Q - row) * BLOCK_Q
    if (q_tile_start >= q_len) | (q_len <= SKIP_QUERY_LEN):
        return
    seq_len = tl.load(seq_lens_ptr + row)
    context_len = seq_len - q_len  # keys cached before this step's first query
    first_head = head_block * HEADS
    kv_head = first_head // GROUP

    # Matrix row i of the tile is token q_tile_start + i // HEADS, query head first_head + i % HEADS.
    m_rows = tl.arange(0, BLOCK_M)
    q_local = q_tile_start + m_rows // HEADS
    head = first_head + m_rows % HEADS
    row_valid = (m_rows < BLOCK_Q * HEADS) & (q_local < q_len)
    token = (q_start + q_local).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    if DOT_F16:  # the K / V tiles follow q's dtype
        q = to_f16_saturated(q)
    if Q_PRESCALE:
        q = (q.to(tl.float32) * qk_scale).to(q.dtype)
    q_pos = tl.minimum(context_len + q_local, seq_len - 1)  # invalid rows clamped; never stored

    kv_hi = tl.minimum(seq_len, context_len + q_tile_start + BLOCK_Q)  # up to the tile's last query
    # Keys before `mid` are visible to every query of the tile: those tiles need no mask.
    mid = tl.minimum(kv_hi, (context_len + q_tile_start + 1) // BLOCK_N * BLOCK_N)
    # With a window the tiles start at `kv_lo` (the first query's window), masked up to `lo` (the last query's).
    kv_lo = 0
    lo = 0
    if HAS_WINDOW:
        kv_lo = _window_start(context_len + q_tile_start, window, BLOCK_N)
        lo = _unmasked_start(kv_hi - 1, window, kv_lo, mid, BLOCK_N)

    # Loop-invariant address parts: K gathered transposed [HEAD_DIM, BLOCK_N], or (not K_TRANS) as V's rows.
    tile_pages, k_offsets, v_offsets = _kv_tile_offsets(kv_head, dims, stride_c_tok, stride_c_head, BLOCK_N, PAGE)
    if not K_TRANS:
        k_offsets = v_offsets
    bt_row_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt_row

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows give p = 0, not NaN
    if HAS_WINDOW:  # the window's lower edge: tiles some query of the tile no longer sees all of
        for start in range(kv_lo, lo, BLOCK_N):
            blocks = _tile_blocks(bt_row_ptr, start, kv_hi, tile_pages, BLOCK_N, PAGE)
            acc, l_i, m_i = _fold_kv_tile(
                acc,
                l_i,
                m_i,
                q,
                start,
                kv_hi,
                q_pos,
                blocks,
                cache_ptr,
                k_offsets,
                v_offsets,
                stride_c_kv,
                stride_c_blk,
                stride_c_tok,
                qk_scale,
                window,
                BLOCK_N,
                PAGE,
                True,
                DOT_IEEE,
                K_TRANS,
                Q_PRESCALE,
                HAS_WINDOW,
            )
    if QK_AHEAD:  # FA3-style overlap: tile i+1's QK^T is issued before tile i's softmax
        # Block ids for the next iteration's K (two tiles ahead) and V (one ahead) are both loaded one iteration
        # early: a value carried over two iterations would stop Triton from pipelining the loop at all.
        v_blocks = _tile_blocks(bt_row_ptr, lo, mid, tile_pages, BLOCK_N, PAGE)
        k_blocks = _tile_blocks(bt_row_ptr, lo + BLOCK_N, mid, tile_pages, BLOCK_N, PAGE)
        s = _scores(
            q,
            _load_k(
                cache_ptr,
                v_blocks,
                lo,
                mid,
                k_offsets,
                stride_c_blk,
                stride_c_tok,
                q.dtype,
                BLOCK_N,
                PAGE,
                True,
                K_TRANS,
            ),
            DOT_IEEE,
        )
        for start in tl.range(lo, mid - BLOCK_N, BLOCK_N, num_stages=LOOP_STAGES, warp_specialize=WARP_SPEC):
            k_blocks_next = _tile_blocks(bt_row_ptr, start + 2 * BLOCK_N, mid, tile_pages, BLOCK_N, PAGE)
            v_blocks_next = _tile_blocks(bt_row_ptr, start + BLOCK_N, mid, tile_pages, BLOCK_N, PAGE)
            s_next = _scores(
                q,
                _load_k(
                    cache_ptr,
                    k_blocks,
                    start + BLOCK_N,
                    mid,
                    k_offsets,
                    stride_c_blk,
                    stride_c_tok,
                    q.dtype,
                    BLOCK_N,
                    PAGE,
                    False,
                    K_TRANS,
                ),
                DOT_IEEE,
            )
            v = _load_v(
                cache_ptr,
                v_blocks,
                start,
                mid,
                v_offsets,
                stride_c_kv,
                stride_c_blk,
                stride_c_tok,
                q.dtype,
                BLOCK_N,
                PAGE,
                False,
            )
            acc, l_i, m_i = _softmax_pv(
                acc, l_i, m_i, s, v, start, mid, q_pos, qk_scale, window, BLOCK_N, False, DOT_IEEE, Q_PRESCALE, False
            )
            s = s_next
            k_blocks = k_blocks_next
            v_blocks = v_blocks_next
        if mid > lo:  # the last full tile: its scores are in s
            v = _load_v(
                cache_ptr,
                v_blocks,
                mid - BLOCK_N,
                mid,
                v_offsets,
                stride_c_kv,
                stride_c_blk,
                stride_c_tok,
                q.dtype,
                BLOCK_N,
                PAGE,
                False,
            )
            acc, l_i, m_i = _softmax_pv(
                acc,
                l_i,
                m_i,
                s,
                v,
                mid - BLOCK_N,
                mid,
                q_pos,
                qk_scale,
                window,
                BLOCK_N,
                False,
                DOT_IEEE,
                Q_PRESCALE,
                False,
            )
    elif PREFETCH_PAGES:  # next tile's block ids loaded a tile ahead, so no load chain blocks the pipeliner
        blocks = _tile_blocks(bt_row_ptr, lo, mid, tile_pages, BLOCK_N, PAGE)
        for start in tl.range(lo, mid, BLOCK_N, num_stages=LOOP_STAGES, warp_specialize=WARP_SPEC):
            next_blocks = _tile_blocks(bt_row_ptr, start + BLOCK_N, mid, tile_pages, BLOCK_N, PAGE)
            acc, l_i, m_i = _fold_kv_tile(
                acc,
                l_i,
                m_i,
                q,
                start,
                kv_hi,
                q_pos,
                blocks,
                cache_ptr,
                k_offsets,
                v_offsets,
                stride_c_kv,
                stride_c_blk,
                stride_c_tok,
                qk_scale,
                window,
                BLOCK_N,
                PAGE,
                False,
                DOT_IEEE,
                K_TRANS,
                Q_PRESCALE,
                HAS_WINDOW,
            )
            blocks = next_blocks
    else:
        for start in tl.range(lo, mid, BLOCK_N, num_stages=LOOP_STAGES, warp_specialize=WARP_SPEC):
            blocks = _tile_blocks(bt_row_ptr, start, mid, tile_pages, BLOCK_N, PAGE)
            acc, l_i, m_i = _fold_kv_tile(
                acc,
                l_i,
                m_i,
                q,
                start,
                kv_hi,
                q_pos,
                blocks,
                cache_ptr,
                k_offsets,
                v_offsets,
                stride_c_kv,
                stride_c_blk,
                stride_c_tok,
                qk_scale,
                window,
                BLOCK_N,
                PAGE,
                False,
                DOT_IEEE,
                K_TRANS,
                Q_PRESCALE,
                HAS_WINDOW,
            )
    for start in range(mid, kv_hi, BLOCK_N):  # the causal diagonal: one or two tiles
        blocks = _tile_blocks(bt_row_ptr, start, kv_hi, tile_pages, BLOCK_N, PAGE)
        acc, l_i, m_i = _fold_kv_tile(
            acc,
            l_i,
            m_i,
            q,
            start,
            kv_hi,
            q_pos,
            blocks,
            cache_ptr,
            k_offsets,
            v_offsets,
            stride_c_kv,
            stride_c_blk,
            stride_c_tok,
            qk_scale,
            window,
            BLOCK_N,
            PAGE,
            True,
            DOT_IEEE,
            K_TRANS,
            Q_PRESCALE,
            HAS_WINDOW,
        )

    if HAS_SINKS:  # the sink's logit joins the denominator only
        l_i = l_i + tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_i)  # log2 e
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim] float32 / float16 / bfloat16, last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,  # query_start_loc [R+1] int32, seq_lens [R] int32, block_tables [R, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]; rows of other tokens are left as they are
    *,
    skip_query_len: int = 0,  # rows with query_len <= this are not computed (the decode launch's rows)
    variant: PrefillVariant | None = None,  # default: `default_variant`
    dot_f16: bool | None = None,  # products in float16; None: when the cache is FP8 (`products_in_f16`)
    window: int = 0,  # > 0: sliding window of this many keys (the query's own included)
    sinks: torch.Tensor | None = None,  # [num_heads] float32: a learned logit per head in each denominator
) -> torch.Tensor:
    """`out` with the causal attention of every row longer than `skip_query_len` over its paged keys.

    Checks of shapes are `triton_paged_attention.paged_attention`'s (its caller); grids come from host ints.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if meta.num_rows == 0 or num_tokens == 0 or meta.max_query_len <= skip_query_len:
        return out
    if variant is None:
        variant = default_variant(head_dim, query.device.type == "cuda", query.element_size())
    heads = variant.heads or group
    assert group % heads == 0, f"PrefillVariant.heads={heads} does not divide the GQA group {group}"
    block_m = max(variant.block_m, next_power_of_2(heads))
    block_q = block_m // heads
    # Row r's tiles start at query_start_loc[r] // block_q + r (see _find_row): ids are not compact, so the
    # grid reaches the last row's last tile; surplus programs exit at once.
    num_tiles = num_tokens // block_q + meta.num_rows
    head_blocks = num_heads // heads
    grid = (head_blocks, num_tiles) if variant.reverse else (num_tiles, head_blocks)
    _prefill_attention_kernel[grid](
        query,
        kv_cache,
        out,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.seq_lens if sinks is None else sinks,  # read only with sinks
        meta.num_rows,
        num_tiles,
        scale * LOG2E,
        window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        GROUP=group,
        HEADS=heads,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=variant.block_n,
        PAGE=block_size,
        SKIP_QUERY_LEN=skip_query_len,
        DOT_IEEE=query.dtype == torch.float32,
        K_TRANS=variant.k_trans,
        Q_PRESCALE=variant.q_prescale,
        REVERSE=variant.reverse,
        LOOP_STAGES=variant.loop_stages or variant.num_stages,
        WARP_SPEC=variant.warp_spec,
        PREFETCH_PAGES=variant.prefetch_pages,
        QK_AHEAD=variant.qk_ahead,
        DOT_F16=products_in_f16(kv_cache.dtype, query.dtype) if dot_f16 is None else dot_f16,
        HAS_WINDOW=window > 0,
        HAS_SINKS=sinks is not None,
        num_warps=variant.num_warps,
        num_stages=variant.num_stages,
    )
    return out
