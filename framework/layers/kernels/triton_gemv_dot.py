"""The tensor-core path of the small-batch projections (2 <= M <= 16 tokens): a "swap AB" GEMM with `tl.dot`.

The GEMV (`triton_gemv._gemv_kernel`) multiplies each weight chunk with the M input rows one at a time, so its
arithmetic grows with M: on the H200 it beats cuBLAS at one row and loses 1.5-6x at eight. An MMA instruction
is at least 16 wide in its n dimension, and a weight tile is 64 or more rows, so this kernel swaps the operands:
out^T [BLOCK_N, BLOCK_MP] = W [BLOCK_N, K] @ x^T [K, BLOCK_MP], the weight rows as the MMA's m dimension and the
M tokens, zero-padded to BLOCK_MP = 16, as its n. Up to 16 tokens cost one MMA shape; the weight is streamed
once through a software-pipelined K loop (`tl.range(num_stages=...)`: the next stages' weight loads are in
flight while this stage multiplies).

Same semantics and rounding points as the GEMV (see its docstring and `small_batch_ops.fused_linear_reference`):
the input chunk is rounded to the weight dtype before the product (bf16 / fp16 feed the MMA directly; float32
runs `input_precision="ieee"`, not TF32), float32 accumulation, bias, each projection output rounded to the
dtype, SiLU(gate) * up from two accumulators (gate rows n, up rows N + n), the result rounded to the dtype and
then cast to the output dtype. Only geometry is `constexpr`; M is a runtime argument, not specialised, so every
M in 2..16 runs one compiled variant per projection.

The launch rules (`dot_tile_shape`) are unmeasured; `scripts/bench_gemv_tiles.py` sweeps them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from framework.layers.kernels.launch_math import next_power_of_2
from framework.layers.kernels.triton_norm_silu import prologue_input, prologue_rstd, round_to_dtype, silu_mul_rounded

MMA_MIN = 16  # tl.dot's smallest dimension: the padded token count and the smallest weight tile
SMEM_BUDGET = 192 * 1024  # bytes of pipelined tiles a program may hold (H100 / H200: 227 KB, less the epilogue's)


@triton.jit
def _mma(w, xt, acc, UPCAST: tl.constexpr):
    """acc + w @ xt; float32 operands as exact float32 products (TF32 would round the inputs to 10 bits)."""
    if UPCAST:
        w, xt = w.to(tl.float32), xt.to(tl.float32)
    if w.dtype == tl.float32:
        return tl.dot(w, xt, acc, input_precision="ieee")
    return tl.dot(w, xt, acc)


@triton.jit(do_not_specialize=["M"])  # per-step size: 2..16 tokens share one variant
def _gemv_dot_kernel(
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
    BLOCK_MP: tl.constexpr,  # padded token count, >= max(16, M): the MMA's n dimension
    BLOCK_N: tl.constexpr,  # weight rows per program: the MMA's m dimension
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # weight chunks in flight (software pipelining of the K loop)
    UPCAST: tl.constexpr,  # interpreter only: bf16 tiles go to tl.dot as float32 (triton_norm_silu.interpreter_upcast)
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (framework/layers/kernels/pdl.py)
):
    if USE_PDL:  # nothing is loaded early: the pipelined K loop reads each weight chunk beside its x chunk
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    dtype = w_ptr.dtype.element_ty
    rows_m = tl.arange(0, BLOCK_MP)
    m_mask = rows_m < M  # padding token columns: x reads 0, nothing is stored
    rstd = tl.zeros([BLOCK_MP], dtype=tl.float32)
    if HAS_NORM:  # pass 1 (before any product: the norm needs whole rows): 1 / rms per row, program 0 the sum
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
            BLOCK_MP,
            BLOCK_K,
            HAS_RESIDUAL,
        )
    cols_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    w_rows = cols_n.to(tl.int64)[:, None] * K  # int64: an LM head's N * K passes 2^31 at large K
    acc = tl.zeros([BLOCK_N, BLOCK_MP], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_MP], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + w_rows + ks[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K] dtype
        xt_mask = k_mask[:, None] & m_mask[None, :]
        xt = prologue_input(
            x_ptr,
            residual_ptr,
            norm_weight_ptr,
            rows_m[None, :] * stride_x + ks[:, None],
            rows_m[None, :] * stride_r + ks[:, None],
            ks[:, None],
            xt_mask,
            k_mask[:, None],
            rstd[None, :],
            dtype,
            HAS_RESIDUAL,
            HAS_NORM,
        )  # [BLOCK_K, BLOCK_MP] float32
        xt = xt.to(dtype)  # exact: prologue_input rounded it to dtype already
        acc = _mma(w, xt, acc, UPCAST)
        if SILU_MUL:
            w_up = tl.load(w_ptr + N * K + w_rows + ks[None, :], mask=w_mask, other=0.0)
            acc_up = _mma(w_up, xt, acc_up, UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y = round_to_dtype(acc, dtype)  # what the projection returns in the model dtype
    if SILU_MUL:
        if HAS_BIAS:
            acc_up += tl.load(bias_ptr + N + cols_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        y = silu_mul_rounded(y, acc_up, dtype)
    out_mask = n_mask[:, None] & m_mask[None, :]
    tl.store(out_ptr + rows_m[None, :] * N + cols_n[:, None], y.to(out_ptr.dtype.element_ty), mask=out_mask)


def dot_tile_shape(
    n: int,
    k: int,
    element_size: int,
    silu_mul: bool = False,
    block_n: int = 0,
    block_k: int = 0,
    num_warps: int = 0,
    num_stages: int = 0,
) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages) of the dot kernel for an [N, K] weight ([2N, K] with `silu_mul`:
    two weight tiles per stage); a nonzero argument fixes that choice (the sweep's candidates), but the stages
    are always capped to what fits SMEM_BUDGET (a launch over the limit fails: 128 x 128 bf16 gate/up tiles at 4
    stages need 260 KB of the H200's 227).

    UNMEASURED GUESSES, for the next GPU sweep (scripts/bench_gemv_tiles.py) to replace: 64 weight rows a
    program (one Hopper warpgroup MMA, m64n16), 128 once N gives more than two programs per SM of an H200 at
    that size (the LM head), 4 warps; K in chunks of 256 bytes of each weight row (128 bf16) with 4 stages in
    flight (64 rows: 64 KB a program, above the ~36 KB per SM that HBM latency times bandwidth asks for).
    Known weakness: at N = 1024 a 64-row tile gives 16 programs for 132 SMs; the sweep also tries 16- and
    32-row tiles (mma.sync instead of wgmma), and split-K would be the next step if those lose.
    """
    block_n = block_n or (128 if n >= 128 * 2 * 132 else 64)
    block_k = block_k or max(MMA_MIN, min(next_power_of_2(k), 256 // element_size))
    assert block_n >= MMA_MIN and block_k >= MMA_MIN, f"tl.dot needs tiles of at least {MMA_MIN}"
    stage_bytes = ((2 if silu_mul else 1) * block_n + MMA_MIN) * block_k * element_size  # weights + x^T (16 cols)
    num_stages = max(1, min(num_stages or 4, SMEM_BUDGET // stage_bytes))
    return block_n, block_k, num_warps or 4, num_stages
