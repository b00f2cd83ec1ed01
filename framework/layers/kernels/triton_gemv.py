"""Small-M GEMV kernels of the decode projections (M = 1..16 tokens), with fused prologue / epilogue.

At batch 1..8 a decode projection is a matrix-vector product: the weight (2-12 MB per layer at the Qwen3-0.6B
geometry, 311 MB for the LM head) is read once and each weight element feeds M multiply-adds, so the kernel is
bound by how fast the weight streams in, and by the fixed cost of each launch. cuBLAS at M = 1 neither reaches
bandwidth on these matrices nor fuses anything; here one kernel does:

- prologue (optional): `weight_norm * rmsnorm(x + residual)`, recomputed by every program (the normed vector is
  M x K, tiny next to the weight); program 0 also writes `x + residual`, the new residual stream;
- the product, row-parallel over the N output features: a program owns BLOCK_N weight rows (a warp each) and
  walks K in BLOCK_K chunks, unrolled (16-byte vector loads of bf16, several chunks in flight), multiplying
  each chunk with the M input rows one at a time ([BLOCK_N, BLOCK_K] products reduced within the warp) and
  accumulating in float32;
- epilogue (optional): bias, and `silu(gate) * up` of a merged gate/up weight (the program reads gate rows n and
  up rows I + n, so the separate silu_and_mul kernel and the [M, 2I] intermediate go).

A program loads its first weight tile (`PRE_K` columns, up to 32 KB: the whole tile of most 0.6B projections)
before it touches any activation: under programmatic dependent launch (`USE_PDL`, framework/layers/kernels/pdl.py) that
happens before `gdc_wait()`, while the previous kernel finishes; the prologue and the product come after it.

Rounding follows the unfused sequence (`small_batch_ops.fused_linear_reference`): the residual sum, the normed
row and its weight product are rounded to the model dtype before the product (as the RMSNorm op does), each
projection output is rounded to the dtype (what `F.linear` returns), SiLU is rounded before its product. Only
the float32 summation order of the dot products differs from cuBLAS.

Only geometry (N, K, dtype, flags, BLOCK_M) is `constexpr`; M is an argument (BLOCK_M = next power of two >= M,
so graphs at M = 1, 2, 4, 8 compile four variants per projection, M = 3 reuses M = 4's).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from framework.layers.kernels.pdl import pdl_launch_kwargs
from framework.layers.kernels.triton_norm_silu import (
    prologue_input,
    prologue_rstd,
    round_to_dtype,
    silu_mul_rounded,
)

MAX_GEMV_ROWS = 16  # M above this: a tensor-core GEMM is the better kernel (and BLOCK_M unrolls stay small)
# Weight bytes a GEMV program loads in its first tile, before it reads any activation (PRE_K): the whole tile of
# every 0.6B projection but down's (K = 3,072: 2,048 columns first), 32 KB of registers over 8 warps.
PREFETCH_BYTES = 32 * 1024


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] row stride stride_x, last dim contiguous
    residual_ptr,  # [M, K] row stride stride_r (x_ptr when not HAS_RESIDUAL; not read)
    norm_weight_ptr,  # [K] (x_ptr when not HAS_NORM; not read)
    w_ptr,  # [N, K] contiguous; with SILU_MUL [2N, K]: gate rows 0..N-1, then up rows N..2N-1
    bias_ptr,  # [N] or [2N] (w_ptr when not HAS_BIAS; not read)
    out_ptr,  # [M, N] contiguous (any float dtype: the value is rounded to w's dtype first)
    summed_ptr,  # [M, K] contiguous: x + residual, written by program 0 (out_ptr when not HAS_RESIDUAL)
    M,
    stride_x,
    stride_r,
    eps,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # power of two >= M
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PRE_K: tl.constexpr = 0,  # power of two: weight columns 0..PRE_K-1 are loaded first, in one tile (0: none)
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (framework/layers/kernels/pdl.py)
):
    pid = tl.program_id(0)
    dtype = w_ptr.dtype.element_ty
    rows_m = tl.arange(0, BLOCK_M)
    cols_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    w_rows = cols_n.to(tl.int64)[:, None] * K  # int64: an LM head's N * K passes 2^31 at large K
    # Pass 0, weights only: the first PRE_K columns of the program's rows (its whole tile when K <= PRE_K) are
    # loaded before anything the previous kernel writes is touched. With USE_PDL this runs while that kernel
    # finishes; without it the loads are in flight during the norm prologue. Same code either way, so PDL on and
    # off give the same bits.
    if PRE_K > 0:
        kp = tl.arange(0, PRE_K)
        wp_mask = n_mask[:, None] & (kp[None, :] < K)
        w_pre = tl.load(w_ptr + w_rows + kp[None, :], mask=wp_mask, other=0.0)  # [BLOCK_N, PRE_K] dtype
        if SILU_MUL:
            w_pre_up = tl.load(w_ptr + N * K + w_rows + kp[None, :], mask=wp_mask, other=0.0)
    if USE_PDL:  # the previous kernel's writes are visible from here on; the next kernel may start loading
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:  # pass 1: each row's 1 / rms (and the new residual stream, by program 0); x is tiny, L2-resident
        rstd = prologue_rstd(
            x_ptr,
            residual_ptr,
            summed_ptr,
            M,
            stride_x,
            stride_r,
            eps,
            pid == 0,
            dtype,
            K,
            BLOCK_M,
            BLOCK_K,
            HAS_RESIDUAL,
        )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PRE_K > 0:  # the preloaded columns, one input row at a time
        for m in tl.static_range(BLOCK_M):
            x_mask = (kp < K) & (tl.full([PRE_K], m, tl.int32) < M)
            rstd_m = tl.sum(tl.where(rows_m == m, rstd, 0.0), axis=0)
            x = prologue_input(
                x_ptr,
                residual_ptr,
                norm_weight_ptr,
                m * stride_x + kp,
                m * stride_r + kp,
                kp,
                x_mask,
                kp < K,
                rstd_m,
                dtype,
                HAS_RESIDUAL,
                HAS_NORM,
            )  # [PRE_K] float32
            is_m = rows_m[:, None] == m
            acc += tl.where(is_m, tl.sum(w_pre.to(tl.float32) * x[None, :], axis=1)[None, :], 0.0)
            if SILU_MUL:
                acc_up += tl.where(is_m, tl.sum(w_pre_up.to(tl.float32) * x[None, :], axis=1)[None, :], 0.0)
    # Pass 2, the rest of the product (all of it when PRE_K = 0), each weight element read once. Unrolled (K is
    # constexpr) and reduced within a warp (a warp owns whole weight rows), so no barrier separates the chunks:
    # the compiler issues the next chunks' weight loads before this chunk's sums, and enough bytes are in flight
    # to stream at HBM speed. A `for` loop here waited one DRAM round trip per chunk (2-4 KB), ~20 % of the
    # bandwidth (issue 25's profile).
    for k0 in tl.static_range(PRE_K, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w_mask = n_mask[:, None] & (ks[None, :] < K)
        w = tl.load(w_ptr + w_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        if SILU_MUL:
            w_up = tl.load(w_ptr + N * K + w_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):  # one input row at a time: registers stay [BLOCK_N, BLOCK_K]
            x_mask = (ks < K) & (tl.full([BLOCK_K], m, tl.int32) < M)  # past M: padding rows read nothing
            rstd_m = tl.sum(tl.where(rows_m == m, rstd, 0.0), axis=0)
            x = prologue_input(
                x_ptr,
                residual_ptr,
                norm_weight_ptr,
                m * stride_x + ks,
                m * stride_r + ks,
                ks,
                x_mask,
                ks < K,
                rstd_m,
                dtype,
                HAS_RESIDUAL,
                HAS_NORM,
            )  # [BLOCK_K] float32
            is_m = rows_m[:, None] == m  # [BLOCK_M, 1]: this row's slot of the accumulators
            acc += tl.where(is_m, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
            if SILU_MUL:
                acc_up += tl.where(is_m, tl.sum(w_up * x[None, :], axis=1)[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = round_to_dtype(acc, dtype)  # what the projection returns in the model dtype
    if SILU_MUL:
        if HAS_BIAS:
            acc_up += tl.load(bias_ptr + N + cols_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = silu_mul_rounded(y, acc_up, dtype)
    out_mask = (rows_m[:, None] < M) & n_mask[None, :]
    tl.store(out_ptr + rows_m[:, None] * N + cols_n[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)


class GemvTiles(NamedTuple):
    """Launch shape of one small-batch projection: `grid` programs of `block_n` weight rows and `num_warps` warps,
    `block_m` the next power of two >= M; a program loads its first `prefetch_k` weight columns as one tile
    before any activation (before `gdc_wait` under programmatic dependent launch), the rest in `block_k` chunks
    after."""

    block_m: int
    block_n: int
    block_k: int
    grid: int
    num_warps: int = 4
    prefetch_k: int = 0


def gemv_tiles(
    m: int,
    n: int,
    k: int,
    element_size: int,
    block_n: int = 0,
    block_k: int = 0,
    num_warps: int = 0,
    silu_mul: bool = False,
    prefetch_k: Optional[int] = None,
) -> GemvTiles:
    """The launch shape for an [m, k] x [n, k]^T product (`silu_mul`: gate and up, [2n, k]); a nonzero `block_n`
    / `block_k` / `num_warps` or a given `prefetch_k` (0: none, else a power of two) fixes that choice
    (1e476a2:scripts/bench_gemv_tiles.py, removed, swept them).

    Defaults, the sweep's best or within 3 % of it at one row on every H200 shape of the 0.6B and 8B geometries
    (docs/benchmarks.md): 8 weight rows and 8 warps a program (a warp per row), K in chunks of 2 KB of weight row
    (1,024 bf16). Fixed rules, nothing tuned at run time. The first tile: the first `PREFETCH_BYTES` of the
    program's weight rows (a power of two of columns, at most K rounded up), so that under programmatic dependent
    launch the weight streams while the previous kernel ends (unmeasured: 1e476a2:scripts/bench_pdl.py, removed,
    compared 0 with this)."""
    block_m = next_power_of_2(max(m, 1))
    block_n = block_n or 8
    num_warps = num_warps or min(block_n, 8)
    block_k = block_k or min(next_power_of_2(k), 2048 // element_size)
    if prefetch_k is None:
        fits = PREFETCH_BYTES // (block_n * element_size * (2 if silu_mul else 1))
        prefetch_k = min(next_power_of_2(k), 1 << (max(fits, 1).bit_length() - 1))
    assert prefetch_k == 0 or prefetch_k & (prefetch_k - 1) == 0, f"prefetch_k {prefetch_k}: a power of two"
    return GemvTiles(block_m, block_n, block_k, cdiv(n, block_n), num_warps, prefetch_k=prefetch_k)


def gemv_triton(
    x: torch.Tensor,  # [M, K] (M <= MAX_GEMV_ROWS), rows may be strided, last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous, x.dtype; with silu_mul [2N, K] (gate rows, then up rows)
    bias: Optional[torch.Tensor] = None,  # [N] / [2N], weight.dtype
    norm_weight: Optional[torch.Tensor] = None,  # [K]: the product reads norm_weight * rmsnorm(x + residual)
    eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,  # [M, K] x.dtype (only with norm_weight)
    silu_mul: bool = False,
    out_dtype: Optional[torch.dtype] = None,  # default weight.dtype; float32 for logits (rounded to dtype first)
    tiles: Optional[GemvTiles] = None,  # the launch shape; default `gemv_tiles(M, N, K, element size, ...)`
    pdl: bool = False,  # programmatic dependent launch (only where `pdl.pdl_supported`; same result either way)
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out [M, N], x + residual [M, K] or None); see `fused_linear_reference` for the semantics."""
    m, k = x.shape
    n = weight.shape[0] // (2 if silu_mul else 1)
    assert m <= MAX_GEMV_ROWS, f"{m} rows > {MAX_GEMV_ROWS}: use a GEMM"
    assert weight.shape == ((2 * n) if silu_mul else n, k) and weight.is_contiguous(), "need contiguous [N, K]"
    assert x.stride(1) == 1 and x.dtype == weight.dtype, f"x {x.dtype} must be {weight.dtype}, last dim contiguous"
    assert residual is None or norm_weight is not None, "the residual add is part of the norm prologue"
    for t in (bias, norm_weight):
        assert t is None or (t.dtype == weight.dtype and t.is_contiguous()), "bias / norm weight: weight.dtype"
    out = torch.empty((m, n), dtype=out_dtype or weight.dtype, device=x.device)
    summed = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        summed = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, summed
    tiles = tiles or gemv_tiles(m, n, k, weight.element_size(), silu_mul=silu_mul)
    assert tiles.block_m >= m and tiles.grid * tiles.block_n >= n, f"{tiles} does not cover [{m}, {n}]"
    _gemv_kernel[(tiles.grid,)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else weight,
        out,
        summed if summed is not None else out,
        m,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        eps,
        N=n,
        K=k,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        BLOCK_M=tiles.block_m,
        PRE_K=tiles.prefetch_k,
        num_warps=tiles.num_warps,
        **pdl_launch_kwargs(pdl),
    )
    return out, summed
