"""Decode attention with the KV tiles shared out equally: each program takes the same number of tiles.

`paged_attention`'s decode launch gives each (row, KV head) its own program (or a few, split by the split
rule): programs are as long as their rows, and a batch of 256 rows x 8 KV heads runs ~8 programs one after
another on each of an H200's 264 slots, each paying its start (metadata, q, block ids, the first KV tile: a
chain of loads) and the last wave part-full. Here, per KV head, the rows' KV tiles are laid end to end
(row 0's tiles, then row 1's, ...) and cut into `num_programs` equal runs: a program walks its run row by row,
writes the rows it holds whole and a partial result (log-sum-exp and output) for the at most two rows it
shares with a neighbour, which the last of a row's programs to finish merges (counted per (row, KV head) in
`split_counters`, as the split merge of `triton_tiles._write_result`).

Decode rows only (one query token per row, `meta.max_query_len == 1`). No host sync: each program sums the
rows' tiles itself from `seq_lens` (`BLOCK_R` >= rows, a power of two), so the grid is fixed by the row count
and CUDA graphs replay it at any lengths. Semantics are `paged_attention_reference`'s; the float32 sums run in
a different order than `paged_attention`'s (the same within rounding, not bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.attention.launch_config import AttentionTiles, decode_tiles, num_sms
from framework.attention.metadata import AttentionMetadata
from framework.attention.triton_tiles import LOG2E, _attend_kv_range, _kv_tile_offsets
from framework.kernels.launch_math import cdiv, next_power_of_2
from framework.kernels.pdl import pdl_launch_kwargs


@triton.jit
def _program_of_tile(t, num_programs, total):
    """The program whose run holds tile `t` (runs start at `p * total // num_programs`)."""
    return ((t + 1) * num_programs - 1) // total


@triton.jit
def _merge_row_parts(out_ptr, part_o_ptr, part_lse_ptr, kv_head, p_first, count, row_tile0, num_programs, total,
                     token, head, m_rows, row_valid, dims, stride_ot, stride_oh,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merge the `count` partial results of one (row, KV head), held by programs p_first .. p_first + count - 1:
    slot 0 of a program whose run starts inside the row (the row is its first), else slot 1 (its last)."""
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    weight = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_run = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    for i in range(count):
        p = p_first + i
        slot = tl.where(p * total // num_programs > row_tile0, 0, 1)
        part = ((kv_head * num_programs + p) * 2 + slot).to(tl.int64)
        lse = tl.load(part_lse_ptr + part * BLOCK_M + m_rows, mask=row_valid, other=float("-inf"),
                      cache_modifier=".cg")
        o = tl.load(part_o_ptr + part * BLOCK_M * HEAD_DIM + m_rows[:, None] * HEAD_DIM + dims[None, :],
                    mask=row_valid[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, lse)
        alpha = tl.exp2(m_run - m_new)
        beta = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * beta[:, None]
        weight = weight * alpha + beta
        m_run = m_new
    out = acc / tl.where(weight > 0.0, weight, 1.0)[:, None]
    tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_rows"])  # per-step sizes: no recompiles mid-run
def _balanced_decode_kernel(
    q_ptr,  # [R, num_heads, HEAD_DIM]: one query token per row
    cache_ptr,  # [2, num_blocks, PAGE, num_kv_heads, HEAD_DIM]
    out_ptr,  # [R, num_heads, HEAD_DIM]
    part_o_ptr,  # [num_kv_heads, num_programs, 2, BLOCK_M, HEAD_DIM] float32
    part_lse_ptr,  # [num_kv_heads, num_programs, 2, BLOCK_M] float32, log2 domain
    query_start_loc_ptr,  # [R+1] int32
    seq_lens_ptr,  # [R] int32
    block_tables_ptr,  # [R, max_blocks] int32
    split_counters_ptr,  # [>= R * num_kv_heads] int32, zero on entry and left zero
    num_rows, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
    stride_bt_row,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # >= GROUP, at least an MMA's 16 rows
    BLOCK_N: tl.constexpr,  # keys of a KV tile
    PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # power of two >= num_rows
    DOT_IEEE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # q, the KV cache and the metadata are written by earlier kernels: wait before any load
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_R)
    in_batch = rows < num_rows
    has_query = tl.load(query_start_loc_ptr + rows + 1, mask=in_batch, other=0) > \
        tl.load(query_start_loc_ptr + rows, mask=in_batch, other=0)  # padding rows of no token read nothing
    row_tiles = tl.where(has_query, tl.cdiv(tl.load(seq_lens_ptr + rows, mask=in_batch, other=0), BLOCK_N), 0)
    ends = tl.cumsum(row_tiles, 0)  # [BLOCK_R]: the tile after each row's last
    total = tl.sum(row_tiles, 0)
    # Fewer tiles than programs: the surplus programs leave, so every run holds a tile (a row's programs are
    # then exactly p_first .. p_last, which the merge counts on).
    num_programs = tl.minimum(tl.num_programs(0), total)
    if p >= num_programs:
        return
    t = p * total // num_programs
    t_end = (p + 1) * total // num_programs
    row = tl.sum((ends <= t).to(tl.int32), 0)  # the row holding tile t
    row_tile0 = tl.sum(tl.where(rows < row, row_tiles, 0), 0)

    m_rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + m_rows % GROUP
    row_valid = m_rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    tile_pages, k_offsets, v_offsets = _kv_tile_offsets(kv_head, dims, stride_c_tok, stride_c_head, BLOCK_N, PAGE)
    while t < t_end:
        seq_len = tl.load(seq_lens_ptr + row)
        token = tl.load(query_start_loc_ptr + row)
        n_tiles = tl.where(tl.load(query_start_loc_ptr + row + 1) > token, tl.cdiv(seq_len, BLOCK_N), 0)
        token = token.to(tl.int64)
        lo = t - row_tile0  # this program's first and last tile of the row
        hi = tl.minimum(t_end - row_tile0, n_tiles)
        q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_valid[:, None], other=0.0)
        q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1
        kv_lo = lo * BLOCK_N
        kv_hi = tl.minimum(seq_len, hi * BLOCK_N)
        mid = tl.maximum(kv_lo, tl.minimum(kv_hi, seq_len // BLOCK_N * BLOCK_N))  # the tail tile is masked
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        acc, l_i, m_i = _attend_kv_range(
            acc, l_i, m_i, q, kv_lo, mid, kv_hi, q_pos, cache_ptr, block_tables_ptr + row.to(tl.int64) * stride_bt_row,
            k_offsets, v_offsets, tile_pages, stride_c_kv, stride_c_blk, stride_c_tok, qk_scale, BLOCK_N, PAGE,
            DOT_IEEE)
        has_keys = l_i > 0.0
        o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        if n_tiles == 0:  # a padding row of no token: nothing to write
            pass
        elif (lo == 0) & (hi == n_tiles):  # the whole row is this program's
            tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        else:  # shared with a neighbour: a partial result, merged by the row's last program to finish
            part = ((kv_head * num_programs + p) * 2 + tl.where(lo > 0, 0, 1)).to(tl.int64)
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part * BLOCK_M + m_rows, lse, mask=row_valid)
            tl.store(part_o_ptr + part * BLOCK_M * HEAD_DIM + m_rows[:, None] * HEAD_DIM + dims[None, :], o,
                     mask=row_valid[:, None])
            p_first = _program_of_tile(row_tile0, num_programs, total)
            count = _program_of_tile(row_tile0 + n_tiles - 1, num_programs, total) - p_first + 1
            counter = split_counters_ptr + row * tl.num_programs(1) + kv_head
            tl.debug_barrier()  # every thread's partial stores before the counter's release
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == count - 1:
                _merge_row_parts(out_ptr, part_o_ptr, part_lse_ptr, kv_head, p_first, count, row_tile0,
                                 num_programs, total, token, head, m_rows, row_valid, dims, stride_ot, stride_oh,
                                 HEAD_DIM, BLOCK_M)
                tl.store(counter, 0)  # the next launch (graph replay) starts at 0
        row_tile0 += n_tiles
        t = row_tile0
        row += 1


def balanced_programs(num_kv_heads: int, device: torch.device, waves: int = 1, programs_per_sm: int = 2) -> int:
    """Programs per KV head: `waves` full sets of `programs_per_sm` resident programs on every multiprocessor."""
    return max(1, cdiv(waves * programs_per_sm * num_sms(device), num_kv_heads))


def balanced_decode_attention(
    query: torch.Tensor,  # [R, num_heads, head_dim]: one token per row
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,  # max_query_len 1
    scale: float,
    split_counters: torch.Tensor,  # [>= R * num_kv_heads] int32 zeros (left zero)
    *,
    num_programs: int = 0,  # per KV head; 0: `balanced_programs`
    tiles: AttentionTiles | None = None,  # block_n / num_warps / num_stages (block_m is the GQA group's)
    pdl: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R, num_heads, head_dim]: each decode row's query over its paged keys, the KV tiles split equally."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert meta.max_query_len <= 1, "balanced decode attention takes one query token per row"
    assert split_counters.dtype == torch.int32 and split_counters.numel() >= meta.num_rows * num_kv_heads
    group = num_heads // num_kv_heads
    on_gpu = query.device.type == "cuda"
    tiles = tiles or decode_tiles(head_dim, group, on_gpu, query.element_size())
    block_m = max(16, next_power_of_2(group))
    if out is None:
        out = torch.empty_like(query)
    if meta.num_rows == 0 or num_tokens == 0:
        return out
    programs = num_programs or balanced_programs(num_kv_heads, query.device)
    part_o = torch.empty((num_kv_heads, programs, 2, block_m, head_dim), dtype=torch.float32, device=query.device)
    part_lse = torch.empty((num_kv_heads, programs, 2, block_m), dtype=torch.float32, device=query.device)
    _balanced_decode_kernel[(programs, num_kv_heads)](
        query, kv_cache, out, part_o, part_lse, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        split_counters, meta.num_rows, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        meta.block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_N=tiles.block_n, PAGE=block_size,
        BLOCK_R=max(16, next_power_of_2(meta.num_rows)), DOT_IEEE=query.dtype == torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch_kwargs(pdl),
    )
    return out
