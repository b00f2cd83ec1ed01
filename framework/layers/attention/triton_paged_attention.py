"""Paged attention in Triton: one varlen kernel family for prefill (any cached prefix + new tokens) and decode.

Semantics are `paged_attention_reference` (framework/layers/attention/paged.py): row `r`'s queries are its tokens
`query_start_loc[r]:query_start_loc[r+1]`, at positions `seq_len - query_len .. seq_len - 1`, and each attends
causally to the row's cached keys `0 .. own position`, read through `block_tables[r]`.

Work is cut into programs of one *query tile* x one KV head. A query tile is `BLOCK_Q` tokens of one row
times the `GROUP` query heads that share the KV head (GQA), flattened into `BLOCK_M = BLOCK_Q * GROUP`
(rounded up to a power of two) matrix rows, so every KV tile is loaded once per group and feeds one
`[BLOCK_M, HEAD_DIM] x [HEAD_DIM, BLOCK_N]` product. Online softmax (base 2) accumulates in float32.

Two launches of the same kernel serve a batch (docs/kernels.md has the grids and the rules):

* *small rows* (query_len <= BLOCK_Q of the decode tiles: decode, draft verification) get one program per
  (row, KV head, KV split); with several splits each program writes a partial result and the last program
  of each (row, KV head) to finish merges them (flash-decoding with the reduce fused in, found by an atomic
  counter per (row, KV head); `fused_reduce=False` merges in a second launch, `_split_kv_reduce_kernel`).
  The number of splits follows `num_kv_splits`.
* *large rows* (prefill chunks) go to `prefill_attention` (triton_prefill_attention.py). With
  `prefill_kernel=False` they take the older launch of this kernel instead (kept to compare against): one
  program per (query tile, KV head) with 128-row tiles; the tile's row is found by a binary search over
  `query_start_loc`, so the grid is sized from host ints only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from framework.layers.attention.launch_config import (  # noqa: F401 - re-exported for tests and benchmarks
    MERGE_UNROLL,
    TRITON_HEAD_DIMS,
    AttentionTiles,
    decode_tiles,
    num_kv_splits,
    num_sms,
    prefill_tiles,
)
from framework.layers.attention.metadata import AttentionMetadata
from framework.layers.attention.triton_prefill_attention import PrefillVariant, prefill_attention
from framework.layers.attention.triton_tiles import (
    LOG2E,
    _attend_kv_range,
    _find_row,
    _kv_tile_offsets,
    _merge_kv_splits,
    _split_len,
    _unmasked_start,
    _window_start,
    _write_result,
    products_in_f16,
    to_f16_saturated,
)
from framework.layers.kernels.pdl import pdl_launch_kwargs


@triton.jit(do_not_specialize=["num_rows", "num_splits"])  # per-step sizes: no recompiles mid-run
def _paged_attention_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM]
    cache_ptr,  # [2, num_blocks, PAGE, num_kv_heads, HEAD_DIM]
    out_ptr,  # [T, num_heads, HEAD_DIM]
    part_o_ptr,  # [R, num_kv_heads, num_splits, BLOCK_M, HEAD_DIM] float32 (IS_SPLIT only)
    part_lse_ptr,  # [R, num_kv_heads, num_splits, BLOCK_M] float32, log2 domain (IS_SPLIT only)
    query_start_loc_ptr,  # [R+1] int32
    seq_lens_ptr,  # [R] int32
    block_tables_ptr,  # [R, max_blocks] int32
    split_counters_ptr,  # [>= R * num_kv_heads] int32, zero on entry and left zero (FUSED_REDUCE only)
    row_order_ptr,  # [R] int32: the rows in launch order (ROW_ORDER only)
    sinks_ptr,  # [num_heads] float32: each head's sink logit (HAS_SINKS only)
    num_rows,
    num_splits,
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
    BLOCK_M: tl.constexpr,  # matrix rows of a query tile (>= BLOCK_Q * GROUP)
    BLOCK_Q: tl.constexpr,  # tokens of a query tile
    BLOCK_N: tl.constexpr,  # keys of a KV tile
    PAGE: tl.constexpr,  # tokens per KV-cache block
    SMALL_ROWS: tl.constexpr,  # True: axis 0 = batch row, rows with query_len > BLOCK_Q skipped
    SKIP_QUERY_LEN: tl.constexpr,  # large rows launch: rows with query_len <= this are skipped
    IS_SPLIT: tl.constexpr,  # write partial results per KV split (axis 2) for the reduce kernel
    DOT_IEEE: tl.constexpr,  # float32 inputs: exact products instead of tf32
    MERGE_UNROLL: tl.constexpr,  # FUSED_REDUCE: KV splits merged per unrolled step
    FUSED_REDUCE: tl.constexpr = False,  # IS_SPLIT: the last split program of a (row, KV head) merges them
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (framework/layers/kernels/pdl.py)
    ROW_ORDER: tl.constexpr = False,  # small rows, unsplit: axis 0 = (row_order[i], KV head), KV heads inner
    NUM_KV_HEADS: tl.constexpr = 1,  # ROW_ORDER only
    DOT_F16: tl.constexpr = False,  # products in float16: q and the K / V tiles converted to it (FP8 caches)
    HAS_WINDOW: tl.constexpr = False,  # sliding window: keys `window` or more positions back are skipped
    HAS_SINKS: tl.constexpr = False,  # one learned logit per head in every softmax denominator
):
    if USE_PDL:  # q, the KV cache and the metadata are all written by earlier kernels: wait before any load
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if SMALL_ROWS:
        row = tl.program_id(0)
        if ROW_ORDER:  # programs start in the order of row_order: all KV heads of its first row, then the next
            row = tl.load(row_order_ptr + tl.program_id(0) // NUM_KV_HEADS)
            kv_head = tl.program_id(0) % NUM_KV_HEADS
        q_tile_start = 0
    else:
        tile = tl.program_id(0)
        row = _find_row(query_start_loc_ptr, num_rows, tile, BLOCK_Q)
        q_tile_start = (tile - tl.load(query_start_loc_ptr + row) // BLOCK_Q - row) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if SMALL_ROWS:
        if (q_len == 0) | (q_len > BLOCK_Q):
            return
    else:
        if (q_tile_start >= q_len) | (q_len <= SKIP_QUERY_LEN):
            return
    seq_len = tl.load(seq_lens_ptr + row)
    context_len = seq_len - q_len  # keys cached before this step's first query

    # Matrix row i of the tile is token q_tile_start + i // GROUP, query head kv_head * GROUP + i % GROUP.
    m_rows = tl.arange(0, BLOCK_M)
    q_local = q_tile_start + m_rows // GROUP
    head = kv_head * GROUP + m_rows % GROUP
    row_valid = (m_rows < BLOCK_Q * GROUP) & (q_local < q_len)
    token = (q_start + q_local).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    if DOT_F16:
        q = to_f16_saturated(q)
    q_pos = tl.minimum(context_len + q_local, seq_len - 1)  # invalid rows clamped; never stored

    # Keys this program reads: up to the tile's last query position (from the first query's window on),
    # within its KV split; the splits divide the keys from `kv_base` on.
    kv_base = 0
    if HAS_WINDOW:
        kv_base = _window_start(context_len + q_tile_start, window, BLOCK_N)
    kv_lo = kv_base
    kv_hi = tl.minimum(seq_len, context_len + q_tile_start + BLOCK_Q)
    split_len = seq_len - kv_base
    if IS_SPLIT:
        split_len = _split_len(seq_len - kv_base, num_splits, BLOCK_N)
        kv_lo = kv_base + split * split_len
        if kv_lo >= seq_len:
            return  # empty split of a short row; the merge skips it too
        kv_hi = tl.minimum(kv_hi, kv_lo + split_len)
    # Keys before `full_hi` are visible to every query of the tile: those tiles need no mask.
    full_hi = (context_len + q_tile_start + 1) // BLOCK_N * BLOCK_N
    mid = tl.maximum(kv_lo, tl.minimum(kv_hi, full_hi))
    lo_unmasked = kv_lo
    if HAS_WINDOW:  # window tiles: keys from here on are inside the window of the tile's last query
        last_q_pos = tl.minimum(seq_len, context_len + q_tile_start + BLOCK_Q) - 1
        lo_unmasked = _unmasked_start(last_q_pos, window, kv_lo, mid, BLOCK_N)
    sink = tl.zeros([BLOCK_M], dtype=tl.float32)  # read only with HAS_SINKS
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 e: to the log2 domain

    tile_pages, k_offsets, v_offsets = _kv_tile_offsets(kv_head, dims, stride_c_tok, stride_c_head, BLOCK_N, PAGE)
    bt_row_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt_row
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked tiles give p = 0, not NaN
    acc, l_i, m_i = _attend_kv_range(
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
        BLOCK_N,
        PAGE,
        DOT_IEEE,
        HAS_WINDOW,
    )
    _write_result(
        acc,
        l_i,
        m_i,
        out_ptr,
        part_o_ptr,
        part_lse_ptr,
        split_counters_ptr,
        row,
        kv_head,
        tl.num_programs(1),
        split,
        num_splits,
        seq_len - kv_base,
        split_len,
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
        IS_SPLIT,
        FUSED_REDUCE,
        MERGE_UNROLL,
        HAS_SINKS,
    )


@triton.jit(do_not_specialize=["num_splits"])  # per-step sizes: no recompiles mid-run
def _split_kv_reduce_kernel(
    out_ptr,  # [T, num_heads, HEAD_DIM]
    part_o_ptr,  # [R, num_kv_heads, num_splits, BLOCK_M, HEAD_DIM] float32
    part_lse_ptr,  # [R, num_kv_heads, num_splits, BLOCK_M] float32
    query_start_loc_ptr,  # [R+1] int32
    seq_lens_ptr,  # [R] int32
    sinks_ptr,  # [num_heads] float32 (HAS_SINKS only)
    num_splits,
    window,  # (HAS_WINDOW only)
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (framework/layers/kernels/pdl.py)
    HAS_WINDOW: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    """Merge the KV splits of one (small row, KV head): softmax-weighted by each split's log-sum-exp."""
    if USE_PDL:  # the partial results are the attention kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if (q_len == 0) | (q_len > BLOCK_Q):
        return
    seq_len = tl.load(seq_lens_ptr + row)
    if HAS_WINDOW:  # the splits divided the keys from the window's first tile on (as in the attention kernel)
        seq_len = seq_len - _window_start(seq_len - q_len, window, BLOCK_N)
    used_splits = tl.cdiv(seq_len, _split_len(seq_len, num_splits, BLOCK_N))

    m_rows = tl.arange(0, BLOCK_M)
    q_local = m_rows // GROUP
    head = kv_head * GROUP + m_rows % GROUP
    sink = tl.zeros([BLOCK_M], dtype=tl.float32)  # read only with HAS_SINKS
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 e
    row_valid = (m_rows < BLOCK_Q * GROUP) & (q_local < q_len)
    dims = tl.arange(0, HEAD_DIM)
    first_part = (row.to(tl.int64) * tl.num_programs(1) + kv_head) * num_splits
    token = (q_start + q_local).to(tl.int64)
    _merge_kv_splits(
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
        HEAD_DIM,
        BLOCK_M,
        MERGE_UNROLL,
        HAS_SINKS,
    )


class SplitBuffers(NamedTuple):
    """Where a small-rows launch with `num_splits` KV splits puts its partial results (`split_buffers`)."""

    fused: bool  # the last split program merges (else `merge_splits_apart` runs after the launch)
    counters: torch.Tensor  # [>= R * num_kv_heads] int32, all zero (a placeholder when not fused: never read)
    part_o: torch.Tensor  # [R, num_kv_heads, num_splits, BLOCK_M, HEAD_DIM] float32 (`out` when unsplit)
    part_lse: torch.Tensor  # [R, num_kv_heads, num_splits, BLOCK_M] float32 (`out` when unsplit)


def split_buffers(
    out: torch.Tensor,
    meta: AttentionMetadata,
    num_kv_heads: int,
    num_splits: int,
    block_m: int,
    fused_reduce: bool,
    split_counters: torch.Tensor | None,
) -> SplitBuffers:
    """The partial-result buffers of a small-rows launch; without `split_counters` a fused merge gets zeroed
    counters of its own (one memset a call: callers that decode often pass a `backend.SplitCounters` buffer)."""
    num_rows, head_dim = meta.num_rows, out.shape[-1]
    split = num_splits > 1
    fused = split and fused_reduce
    if fused and split_counters is None:
        split_counters = torch.zeros(num_rows * num_kv_heads, dtype=torch.int32, device=out.device)
    if fused:
        assert (
            split_counters is not None
            and split_counters.dtype == torch.int32
            and split_counters.numel() >= num_rows * num_kv_heads
        ), "split_counters: >= R * num_kv_heads int32"
    if not split:
        return SplitBuffers(False, meta.seq_lens, out, out)
    part_o = torch.empty(
        (num_rows, num_kv_heads, num_splits, block_m, head_dim), dtype=torch.float32, device=out.device
    )
    part_lse = torch.empty((num_rows, num_kv_heads, num_splits, block_m), dtype=torch.float32, device=out.device)
    return SplitBuffers(fused, split_counters if fused else meta.seq_lens, part_o, part_lse)


def merge_splits_apart(
    out: torch.Tensor,
    bufs: SplitBuffers,
    meta: AttentionMetadata,
    num_kv_heads: int,
    num_splits: int,
    group: int,
    tiles: AttentionTiles,
    pdl: bool,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """The second launch that merges a split small-rows launch's partials into `out`, unless it merged them
    itself (`bufs.fused`) or was not split."""
    if num_splits <= 1 or bufs.fused:
        return
    _split_kv_reduce_kernel[(meta.num_rows, num_kv_heads)](
        out,
        bufs.part_o,
        bufs.part_lse,
        meta.query_start_loc,
        meta.seq_lens,
        meta.seq_lens if sinks is None else sinks,
        num_splits,
        window,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=out.shape[-1],
        GROUP=group,
        BLOCK_M=tiles.block_m,
        BLOCK_Q=tiles.block_m // group,
        BLOCK_N=tiles.block_n,
        MERGE_UNROLL=MERGE_UNROLL,
        HAS_WINDOW=window > 0,
        HAS_SINKS=sinks is not None,
        num_warps=4,
        **pdl_launch_kwargs(pdl),
    )


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim] float32 / float16 / bfloat16, last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,  # query_start_loc [R+1] int32, seq_lens [R] int32, block_tables [R, max_blocks] int32
    scale: float,
    *,
    num_splits: int | None = None,  # override the split rule for small rows (tests)
    small_tiles: AttentionTiles | None = None,  # override the tile configs (tests, benchmarks)
    large_tiles: AttentionTiles | None = None,  # the older large-row launch's (prefill_kernel=False)
    prefill_kernel: bool = True,  # large rows to `prefill_attention`; False: the older launch (comparisons)
    prefill_variant: PrefillVariant | None = None,  # prefill_attention's variant (default: default_variant)
    pdl: bool = False,  # programmatic dependent launch (only where framework.layers.kernels.pdl.pdl_supported)
    split_counters: torch.Tensor | None = None,  # [>= R * num_kv_heads] int32 on query's device, all zero
    fused_reduce: bool = True,  # False: merge KV splits in a second launch (comparison, benchmarks)
    merge_unroll: int = MERGE_UNROLL,  # KV splits a fused merge takes per unrolled step (1: one at a time)
    row_order: torch.Tensor | None = None,  # [R] int32, a permutation of the rows: unsplit small rows start in it
    out: torch.Tensor | None = None,  # [>= T, num_heads, head_dim] query.dtype, contiguous rows: written in place
    dot_f16: bool | None = None,  # products in float16; None: when the cache is FP8 (see `products_in_f16`)
    window: int = 0,  # > 0: sliding window, a query at p sees keys p - window + 1 .. p (KV tiles before skipped)
    sinks: torch.Tensor | None = None,  # [num_heads] float32: a learned logit per head in each softmax denominator
) -> torch.Tensor:
    """[T, num_heads, head_dim]: causal attention of each batch row's queries over its paged keys.

    `window` and `sinks` (gpt-oss, Gemma, Mistral) are compile-time switches of the same kernels: without
    them the kernels compile to the full-attention code.

    Tokens past `query_start_loc[R]` (padding) are left unwritten. No host sync: grids come from
    `query.shape`, `meta.num_rows`, `meta.max_query_len` and `meta.max_seq_len`.

    Split-KV decode merges its splits inside the attention launch (`fused_reduce`), counting finished splits
    per (batch row, KV head) in `split_counters` (index `row * num_kv_heads + kv_head`): the caller keeps
    that buffer across steps and CUDA-graph replays (`SplitCounters` in backend.py owns one per model),
    since the kernel leaves it zero again. Without one, a zeroed buffer is allocated for this call (one
    memset more per launch).

    `row_order` (used when the small rows run unsplit): their programs start row by row in this order, all KV
    heads of a row together. Longest rows first (`row_order.rows_longest_first`) keeps a batch of mixed lengths from
    ending on a few long rows while the rest of the GPU idles.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim, f"query head_dim {head_dim} != cache head_dim {cache_head_dim}"
    assert head_dim in TRITON_HEAD_DIMS, (
        f"Triton paged attention needs a power-of-two head_dim in "
        f"16..512 (64 and 128 are the tuned ones), got {head_dim}"
    )
    assert block_size & (block_size - 1) == 0, f"KV block_size must be a power of two, got {block_size}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly"
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be the contiguous axis"
    group = num_heads // num_kv_heads
    assert window >= 0, f"window must be >= 0 (0: none), got {window}"
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.dtype == torch.float32, "sinks: [num_heads] float32"
    dot_f16 = products_in_f16(kv_cache.dtype, query.dtype) if dot_f16 is None else dot_f16
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    else:
        assert out.shape[1:] == query.shape[1:] and out.dtype == query.dtype and out.is_contiguous(), "bad out"
        out = out[:num_tokens]
    num_rows = meta.num_rows
    if num_rows == 0 or num_tokens == 0:
        return out
    on_gpu = query.device.type == "cuda"
    sms = num_sms(query.device)
    small = small_tiles or decode_tiles(head_dim, group, on_gpu, query.element_size())
    large = large_tiles or prefill_tiles(head_dim, group, on_gpu, query.element_size())
    small_q = small.block_m // group  # tokens a small row may have
    all_small = meta.max_query_len <= small_q
    # Keys a row reads at most: a window bounds them (what the split rule and the decode tiles size for).
    span = meta.max_seq_len if window <= 0 else min(meta.max_seq_len, window + meta.max_query_len)
    if small_tiles is None and all_small:
        # Decode-only batches (in CUDA graphs, whose capture compiles the variant): the KV tiles follow the batch
        # shape (block_m does not). Mixed batches keep the default tiles: no new variant to compile mid-run.
        small = decode_tiles(
            head_dim,
            group,
            on_gpu,
            query.element_size(),
            num_programs=num_rows * num_kv_heads,
            max_seq_len=span,
            num_sms=sms,
        )
    if num_splits is None:
        # Mixed batches hold a prefill chunk that fills the GPU anyway: their small rows run unsplit.
        num_splits = num_kv_splits(num_rows, num_kv_heads, span, sms, small.block_n) if all_small else 1

    bufs = split_buffers(out, meta, num_kv_heads, num_splits, small.block_m, fused_reduce, split_counters)
    ordered = row_order is not None and num_splits == 1
    common = dict(
        query_start_loc_ptr=meta.query_start_loc,
        seq_lens_ptr=meta.seq_lens,
        block_tables_ptr=meta.block_tables,
        split_counters_ptr=bufs.counters,  # read only by a fused merge
        row_order_ptr=row_order if ordered else meta.seq_lens,  # read only by an ordered small-rows launch
        sinks_ptr=meta.seq_lens if sinks is None else sinks,  # read only with sinks
        num_rows=num_rows,
        qk_scale=scale * LOG2E,
        window=window,
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_c_kv=kv_cache.stride(0),
        stride_c_blk=kv_cache.stride(1),
        stride_c_tok=kv_cache.stride(2),
        stride_c_head=kv_cache.stride(3),
        stride_bt_row=meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        GROUP=group,
        PAGE=block_size,
        DOT_IEEE=query.dtype == torch.float32,
        MERGE_UNROLL=merge_unroll,
        HAS_WINDOW=window > 0,
        HAS_SINKS=sinks is not None,
    )
    if not all_small and prefill_kernel:  # the large rows (prefill chunks) in the prefill kernel
        prefill_attention(
            query,
            kv_cache,
            meta,
            scale,
            out,
            skip_query_len=small_q,
            variant=prefill_variant,
            dot_f16=dot_f16,
            window=window,
            sinks=sinks,
        )
    elif not all_small:
        block_q = large.block_m // group
        # Row r's tiles start at query_start_loc[r] // block_q + r (see _find_row): ids are not compact, so
        # the grid must reach the last row's last tile; surplus programs exit at once.
        num_tiles = num_tokens // block_q + num_rows
        _paged_attention_kernel[(num_tiles, num_kv_heads, 1)](
            query,
            kv_cache,
            out,
            out,
            out,
            num_splits=1,
            BLOCK_M=large.block_m,
            BLOCK_Q=block_q,
            BLOCK_N=large.block_n,
            SMALL_ROWS=False,
            SKIP_QUERY_LEN=small_q,
            IS_SPLIT=False,
            DOT_F16=dot_f16,
            num_warps=large.num_warps,
            num_stages=large.num_stages,
            **common,
            **pdl_launch_kwargs(pdl),
        )
    grid = (num_rows * num_kv_heads, 1, 1) if ordered else (num_rows, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query,
        kv_cache,
        out,
        bufs.part_o,
        bufs.part_lse,
        num_splits=num_splits,
        BLOCK_M=small.block_m,
        BLOCK_Q=small_q,
        BLOCK_N=small.block_n,
        SMALL_ROWS=True,
        SKIP_QUERY_LEN=0,
        IS_SPLIT=num_splits > 1,
        FUSED_REDUCE=bufs.fused,
        ROW_ORDER=ordered,
        NUM_KV_HEADS=num_kv_heads if ordered else 1,
        DOT_F16=dot_f16,
        num_warps=small.num_warps,
        num_stages=small.num_stages,
        **common,
        **pdl_launch_kwargs(pdl),
    )
    merge_splits_apart(out, bufs, meta, num_kv_heads, num_splits, group, small, pdl, window, sinks)
    return out
