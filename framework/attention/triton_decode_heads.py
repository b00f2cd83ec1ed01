"""Decode attention with several KV heads per program: one pipelined stream of KV tiles across heads.

A batch of small rows (decode, draft verification) without KV splits gives `_paged_attention_kernel` one program
per (row, KV head). At "nano"'s contexts (600-1,900 keys) that program streams only 5-15 tiles of 128 keys, and
its start (query load, the first tile's latency) and end are not hidden behind another program's stream: 3.7-3.9
TB/s against 4.3 for long rows (docs/benchmarks.md, "Attention kernels"). Here a program takes `HEADS`
consecutive KV heads of one row and walks all their tiles as one loop, head after head, so Triton's software
pipeline loads the next head's first tiles while the previous head's last ones are multiplied. The softmax state
restarts at each head's first tile; each head's result is stored after its last tile.

Same semantics as the small-rows launch of `_paged_attention_kernel` with one split (and so as
`paged_attention_reference`): row r's queries are its last `query_len` positions, each attending causally.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.attention.launch_config import AttentionTiles
from framework.attention.metadata import AttentionMetadata
from framework.attention.triton_paged_attention import LOG2E, _attend_kv_tile


@triton.jit
def _decode_heads_kernel(
    q_ptr,  # [T, num_heads, HEAD_DIM]
    cache_ptr,  # [2, num_blocks, PAGE, num_kv_heads, HEAD_DIM]
    out_ptr,  # [T, num_heads, HEAD_DIM]
    query_start_loc_ptr,  # [R+1] int32
    seq_lens_ptr,  # [R] int32
    block_tables_ptr,  # [R, max_blocks] int32
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
    stride_bt_row,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # matrix rows of a query tile (>= BLOCK_Q * GROUP)
    BLOCK_Q: tl.constexpr,  # tokens a row may have (longer rows are skipped: not this launch's)
    BLOCK_N: tl.constexpr,  # keys of a KV tile
    PAGE: tl.constexpr,  # tokens per KV-cache block
    HEADS: tl.constexpr,  # KV heads per program (axis 1 = group of HEADS heads)
    DOT_IEEE: tl.constexpr,  # float32 inputs: exact products instead of tf32
):
    row = tl.program_id(0)
    first_kv_head = tl.program_id(1) * HEADS
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if (q_len == 0) | (q_len > BLOCK_Q):
        return
    seq_len = tl.load(seq_lens_ptr + row)
    context_len = seq_len - q_len

    # Matrix row i of a head's tile is token i // GROUP, query head kv_head * GROUP + i % GROUP.
    m_rows = tl.arange(0, BLOCK_M)
    q_local = m_rows // GROUP
    row_valid = (m_rows < BLOCK_Q * GROUP) & (q_local < q_len)
    token = (q_start + q_local).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q_pos = tl.minimum(context_len + q_local, seq_len - 1)  # invalid rows clamped; never stored

    # In-page address parts, the same for every tile and head (the head is added to the cache base below).
    n_offs = tl.arange(0, BLOCK_N)
    if PAGE >= BLOCK_N:
        tile_pages = n_offs * 0
        tok_offs = n_offs * stride_c_tok
    else:
        tile_pages = n_offs // PAGE
        tok_offs = (n_offs % PAGE) * stride_c_tok
    k_offsets = dims[:, None] + tok_offs[None, :]  # [HEAD_DIM, BLOCK_N]: K tile loaded transposed
    v_offsets = tok_offs[:, None] + dims[None, :]  # [BLOCK_N, HEAD_DIM]
    bt_row_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt_row

    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    # One loop over (head, tile) pairs, so the pipeline never drains between heads. Every tile goes through the
    # masked path: at one to a few queries per row the mask is a few compares next to a 64 KB tile read.
    for step in range(0, HEADS * num_tiles):
        kv_head = first_kv_head + step // num_tiles
        start = (step % num_tiles) * BLOCK_N
        fresh = start == 0  # a head's first tile: its softmax state starts over
        acc = tl.where(fresh, 0.0, acc)
        l_i = tl.where(fresh, 0.0, l_i)
        m_i = tl.where(fresh, -1.0e30, m_i)
        head = kv_head * GROUP + m_rows % GROUP
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_valid[:, None], other=0.0)  # a few hundred bytes, from L2 after the first head
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, start, seq_len, q_pos, cache_ptr + kv_head * stride_c_head, bt_row_ptr, k_offsets,
            v_offsets, tile_pages, stride_c_kv, stride_c_blk, stride_c_tok, qk_scale, BLOCK_N, PAGE, True, DOT_IEEE)
        # The head's last tile: store its result (the scalar test spread over the rows: the interpreter refuses
        # a mask made of a vector and a scalar).
        store_rows = row_valid & (m_rows * 0 + start + BLOCK_N >= seq_len)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store_rows[:, None])


def decode_heads_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,  # every row has at most tiles.block_m // group tokens (decode, draft verification)
    scale: float,
    heads_per_program: int,  # divides num_kv_heads
    tiles: AttentionTiles,  # small-row tiles (`decode_tiles`)
) -> torch.Tensor:
    """[T, num_heads, head_dim]: causal attention of small rows, `heads_per_program` KV heads per program.

    The caller checks that every row is small (`meta.max_query_len <= tiles.block_m // group`); the kernel skips
    longer rows, leaving their outputs unwritten. Padding tokens past `query_start_loc[R]` are unwritten.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert num_kv_heads % heads_per_program == 0, \
        f"heads_per_program={heads_per_program} must divide the {num_kv_heads} KV heads"
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if meta.num_rows == 0 or num_tokens == 0:
        return out
    _decode_heads_kernel[(meta.num_rows, num_kv_heads // heads_per_program)](
        query, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_m // group, BLOCK_N=tiles.block_n,
        PAGE=block_size, HEADS=heads_per_program, DOT_IEEE=query.dtype == torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
