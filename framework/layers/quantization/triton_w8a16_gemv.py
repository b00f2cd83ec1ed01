"""Small-M GEMV of FP8 weights and 16-bit activations (W8A16 decode, M = 1..16 rows), dequantizing in registers.

At decode a projection reads its whole weight once and does M multiply-adds per weight element, so its time is the
weight's bytes over the memory bandwidth. The tensor-core GEMM of `triton_w8a16` spends 16-row tiles on 1..16 rows
and reaches a fraction of the bandwidth there; this kernel is shaped like the bf16 GEMV
(framework/layers/kernels/triton_gemv.py): a program owns `BLOCK_N` weight rows (a warp each) and walks K in
`BLOCK_K`-column chunks (512 bytes of a row: one 16-byte load a lane, so a row's sums stay inside its warp),
unrolled (K is `constexpr`) so that the next chunks' loads are in flight while this chunk's sums run. Each
chunk's e4m3 bytes widen to float32 and are multiplied by their scales in registers (the chunk seen as
`[BLOCK_N, BLOCK_K / SUB_K, SUB_K]`, one scale per `SUB_K` columns), then the M input rows are multiplied one at a
time and reduced within the warp into float32 accumulators `[BLOCK_N, BLOCK_M]`, kept in the layout the row sums
come out in (the activation chunk's broadcast is the only shared-memory round trip per chunk).

Scales: the float32 `[ceil(N / group_n), ceil(K / group_k)]` grid of `triton_w8a16` (block 128 x 128, per channel
`(1, K)`, per tensor `(N, K)`). With one group along K (per channel, per tensor) the scale multiplies each row's
sum once at the end instead. Numerically the kernel computes `w8a16_linear_reference` (float32 products of the
dequantized weight, float32 sums, one rounding to the activation dtype) up to the summation order.

Launch: `BLOCK_N` = 8 rows (8 warps) when that makes at least two programs per SM of an H100 (132 SMs), else 4,
so N = 4,096 runs 512 programs and N = 1,024 runs 256; no split-K (nothing to reduce across programs, so results
are the same run to run). Only geometry is `constexpr` (and BLOCK_M, the next power of two >= M).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2

QUANT_GEMV_MAX_ROWS = 16  # rows above this: the tensor-core GEMM kernels (triton_w8a16 / triton_w4a16)
UNROLL_ROWS = 4  # BLOCK_M up to this: the row loop unrolled (see `accumulate_rows`)
SM_COUNT = 132  # H100 SXM; the launch rule wants >= 2 programs per SM at this count
# Bytes of a weight row per unrolled chunk: one 16-byte vector a lane, so that the compiler's layout puts the chunk
# of a row in one warp (a wider chunk spreads a row over warps: the sums then cross warps through shared memory).
CHUNK_ROW_BYTES = 32 * 16


@triton.jit
def accumulate_rows(acc, w, x_ptr, stride_x, ks, k_mask, M, UNROLL_M: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] float32 + the products of the dequantized chunk w [BLOCK_N, BLOCK_K] with each input
    row's columns `ks` ([BLOCK_K], `k_mask` inside K), one row at a time (registers stay [BLOCK_N, BLOCK_K]).
    UNROLL_M: the rows unrolled (BLOCK_M of them, past M reading nothing), so the compiler may issue the next
    chunks' weight loads before these sums; else a loop over the M rows, whose code does not grow with M (an
    unrolled M = 16 at K = 12,288 compiled for minutes)."""
    BLOCK_M: tl.constexpr = acc.shape[1]
    rows_m = tl.arange(0, BLOCK_M)
    if UNROLL_M:
        for m in tl.static_range(BLOCK_M):
            x_mask = k_mask & (tl.full(ks.shape, m, tl.int32) < M)
            x = tl.load(x_ptr + m * stride_x + ks, mask=x_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
            acc += tl.where(rows_m[None, :] == m, tl.sum(w * x[None, :], axis=1)[:, None], 0.0)
    else:
        for m in range(M):
            x = tl.load(x_ptr + m * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
            acc += tl.where(rows_m[None, :] == m, tl.sum(w * x[None, :], axis=1)[:, None], 0.0)
    return acc


@triton.jit
def _w8a16_gemv_kernel(
    x_ptr,  # [M, K] activation dtype, row stride stride_x, last dim contiguous
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    s_ptr,  # [SN, SK] float32, contiguous: the scale of weight tile (n // GROUP_N, k // GROUP_K)
    b_ptr,  # [N] activation dtype (y_ptr when not HAS_BIAS; not read)
    y_ptr,  # [M, N] activation dtype, contiguous
    M,
    stride_x,
    N: tl.constexpr,
    K: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    SUB_K: tl.constexpr,  # power of two dividing BLOCK_K and GROUP_K: columns of a chunk that share a scale
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # power of two >= M
    UNROLL_M: tl.constexpr,  # BLOCK_M <= UNROLL_ROWS: the row loop unrolled (`accumulate_rows`)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    SK: tl.constexpr = (K + GROUP_K - 1) // GROUP_K
    ONE_GROUP: tl.constexpr = GROUP_K >= K  # per channel / per tensor: scale each row's sum once
    NG: tl.constexpr = BLOCK_K // SUB_K
    rows_m = tl.arange(0, BLOCK_M)
    rows_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows_n < N
    w_rows = rows_n.to(tl.int64)[:, None] * K  # int64: N * K passes 2^31 for an LM head
    s_rows = (rows_n // GROUP_N) * SK  # [BLOCK_N] offset of each row's scale row
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # [n, m]: the row sums' own layout, no conversion
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: later chunks' loads issue before this chunk's sums
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_ptr + w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w = w.to(tl.float32)  # [BLOCK_N, BLOCK_K]: exact, every e4m3 value is a float32
        if not ONE_GROUP:
            groups = (k0 + tl.arange(0, NG) * SUB_K) // GROUP_K  # [NG] scale column of each SUB_K columns
            s_mask = n_mask[:, None] & (groups < SK)[None, :]
            scale = tl.load(s_ptr + s_rows[:, None] + groups[None, :], mask=s_mask, other=0.0)  # [BLOCK_N, NG]
            w = tl.reshape(tl.reshape(w, (BLOCK_N, NG, SUB_K)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
        acc = accumulate_rows(acc, w, x_ptr, stride_x, ks, k_mask, M, UNROLL_M)
    if ONE_GROUP:
        acc *= tl.load(s_ptr + s_rows, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_mask = n_mask[:, None] & (rows_m[None, :] < M)
    tl.store(y_ptr + rows_m[None, :] * N + rows_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


class QuantGemvTiles(NamedTuple):
    """Launch shape of a quantized GEMV: `grid` programs of `block_n` weight rows and `num_warps` warps, `block_m`
    the next power of two >= M, K walked in chunks of `block_k` columns."""

    block_m: int
    block_n: int
    block_k: int
    grid: int
    num_warps: int


def quant_gemv_tiles(
    m: int, n: int, k: int, column_bits: int = 8, block_n: int = 0, block_k: int = 0
) -> QuantGemvTiles:
    """The launch shape for an [m, k] x [n, k]^T product of `column_bits`-bit weights (8: FP8, 4: INT4); a nonzero
    `block_n` / `block_k` (powers of two) fixes that choice. Default: 8 rows a program if that gives >= 2 programs
    per SM, else 4 (a warp per row); chunks of `CHUNK_ROW_BYTES` of each row (512 FP8 / 1,024 INT4 columns; K
    rounded up to a power of two when smaller). Not yet swept on the GPU."""
    block_n = block_n or (8 if cdiv(n, 8) >= 2 * SM_COUNT else 4)
    block_k = block_k or min(next_power_of_2(k), CHUNK_ROW_BYTES * 8 // column_bits)
    assert block_k & (block_k - 1) == 0 and block_n & (block_n - 1) == 0, "block_n, block_k: powers of two"
    return QuantGemvTiles(next_power_of_2(max(m, 1)), block_n, block_k, cdiv(n, block_n), block_n)


def shared_scale_span(group: int, total: int, block: int) -> int:
    """Columns of a `block`-column chunk that are sure to share one scale group: the chunk when one group spans all
    `total` columns, else the largest power of two dividing `group`, at most `block` (so groups that are not powers
    of two, e.g. 192, still work, in smaller pieces)."""
    return block if group >= total else min(group & -group, block)


def w8a16_gemv_triton(
    x: torch.Tensor,  # [M, K] activation dtype (bf16 / fp16 / fp32), M <= QUANT_GEMV_MAX_ROWS, last dim contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor,  # [ceil(N / group_n), ceil(K / group_k)] float32
    group_n: int,
    group_k: int,
    bias: Optional[torch.Tensor] = None,  # [N] activation dtype
    tiles: Optional[QuantGemvTiles] = None,  # default `quant_gemv_tiles(M, N, K)`
) -> torch.Tensor:  # [M, N] in x's dtype
    """The GEMV; same semantics as `triton_w8a16.w8a16_linear_reference` (float32 summation order aside). No host
    sync and a fixed-shape output, so CUDA graphs capture it."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= QUANT_GEMV_MAX_ROWS, f"{m} rows > {QUANT_GEMV_MAX_ROWS}: use w8a16_linear_triton"
    assert weight.shape == (n, k) and weight.dtype == torch.float8_e4m3fn and weight.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (cdiv(n, group_n), cdiv(k, group_k))
    assert x.stride(-1) == 1 and (bias is None or bias.shape == (n,))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    tiles = tiles or quant_gemv_tiles(m, n, k)
    assert tiles.block_m >= m and tiles.grid * tiles.block_n >= n, f"{tiles} does not cover [{m}, {n}]"
    _w8a16_gemv_kernel[(tiles.grid,)](
        x,
        weight,
        scale.contiguous(),
        bias if bias is not None else y,
        y,
        m,
        x.stride(0),
        N=n,
        K=k,
        GROUP_N=group_n,
        GROUP_K=group_k,
        SUB_K=shared_scale_span(group_k, k, tiles.block_k),
        HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m,
        UNROLL_M=tiles.block_m <= UNROLL_ROWS,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
    )
    return y
