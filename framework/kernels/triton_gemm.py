"""The mid-batch decode projections (17-256 tokens): a split-K tensor-core GEMM with an optional SiLU * up epilogue.

At these sizes cuBLAS runs the Qwen3-0.6B geometry's small weights (1-12 MB a projection) at ~1.1 TB/s
(docs/benchmarks.md, issue 25): an [M <= 256, N = 1,024] output is a handful of 128 x 128 tiles for 132 SMs,
so most of the GPU idles while a few programs walk the whole K. This kernel tiles the output as the small-batch
dot kernel does (`triton_gemv_dot.py`: weight rows as the MMA's m dimension, tokens as its n) and also splits
K over `split_k` programs per tile, so that a small output still occupies every SM. Each split writes its
float32 partial product; the last split of a tile to finish (an atomic counter per tile, as the split-KV
attention merge does) sums the partials in split order, adds the bias, applies SiLU(gate) * up when asked,
rounds and stores. The sum's order is fixed, so the result does not depend on which split finishes last.

Semantics: `F.linear` (float32 accumulation, the bias added before rounding to the model dtype), then with
`silu_mul` the rounding points of `silu_and_mul` (`triton_norm_silu.silu_mul_rounded`). The summation order
differs from cuBLAS's as one cuBLAS algorithm's differs from another's: equal within float32 rounding.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from framework.kernels.launch_math import next_power_of_2
from framework.kernels.split_counters import SplitCounters
from framework.kernels.triton_gemv_dot import _mma
from framework.kernels.triton_norm_silu import interpreter_upcast, round_to_dtype, silu_mul_rounded


@triton.jit
def _k_loop(x_ptr, w_ptr, rows_m, m_mask, w_rows, n_mask, k_lo, k_hi, K, stride_x, acc,
            BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr):
    """acc + W[rows, k_lo:k_hi] @ x[tokens, k_lo:k_hi]^T, software-pipelined over BLOCK_K chunks."""
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_ptr + w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xt = tl.load(x_ptr + rows_m[None, :] * stride_x + ks[:, None], mask=k_mask[:, None] & m_mask[None, :],
                     other=0.0)
        acc = _mma(w, xt, acc, UPCAST)
    return acc


@triton.jit(do_not_specialize=["M"])  # per-step size: every M of a tile shape shares one variant
def _gemm_kernel(
    x_ptr,  # [M, K] row stride stride_x, last dim contiguous
    w_ptr,  # [N, K] contiguous; with SILU_MUL [2N, K]: gate rows 0..N-1, then up rows N..2N-1
    bias_ptr,  # [N] / [2N] (w_ptr when not HAS_BIAS; not read)
    out_ptr,  # [M, N] contiguous
    part_ptr,  # [SPLIT_K, PARTS, M, N] float32 (PARTS = 2 with SILU_MUL); out_ptr when SPLIT_K == 1, not used
    counter_ptr,  # [tiles] int32 zeros (SPLIT_K > 1): finished splits per output tile, reset by the last one
    M, N, K, stride_x, k_per_split,
    BLOCK_N: tl.constexpr,  # weight rows per program: the MMA's m dimension
    BLOCK_M: tl.constexpr,  # tokens per program: the MMA's n dimension
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: bfloat16 tiles go to tl.dot as float32 (interpreter_upcast)
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile // tiles_n, tile % tiles_n  # neighbours share a token tile: x is read from L2
    dtype = w_ptr.dtype.element_ty
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows_m < M
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    w_rows = cols_n.to(tl.int64)[:, None] * K
    k_lo = split * k_per_split
    k_hi = k_lo + k_per_split
    acc = _k_loop(x_ptr, w_ptr, rows_m, m_mask, w_rows, n_mask, k_lo, k_hi, K, stride_x,
                  tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), BLOCK_K, NUM_STAGES, UPCAST)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SILU_MUL:
        acc_up = _k_loop(x_ptr, w_ptr + N * K, rows_m, m_mask, w_rows, n_mask, k_lo, k_hi, K, stride_x, acc_up,
                         BLOCK_K, NUM_STAGES, UPCAST)
    out_offs = rows_m[None, :] * N + cols_n[:, None]  # [BLOCK_N, BLOCK_M]: out^T tile
    out_mask = n_mask[:, None] & m_mask[None, :]
    finish = True
    if SPLIT_K > 1:
        parts = 2 if SILU_MUL else 1
        tl.store(part_ptr + (split * parts) * M * N + out_offs, acc, mask=out_mask)
        if SILU_MUL:
            tl.store(part_ptr + (split * parts + 1) * M * N + out_offs, acc_up, mask=out_mask)
        # Every thread's partial stores before the counter: the barrier orders them before the one thread that
        # increments it, whose release publishes them to the reducing program (its acquire).
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        finish = done == SPLIT_K - 1
        if finish:  # the last split of this tile: the partials summed in split order (independent of arrival)
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part_ptr + (s * parts) * M * N + out_offs, mask=out_mask, other=0.0)
                if SILU_MUL:
                    acc_up += tl.load(part_ptr + (s * parts + 1) * M * N + out_offs, mask=out_mask, other=0.0)
            tl.store(counter_ptr + tile, 0)  # every split has counted: the next launch (graph replay) starts at 0
    if finish:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        y = round_to_dtype(acc, dtype)
        if SILU_MUL:
            if HAS_BIAS:
                acc_up += tl.load(bias_ptr + N + cols_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            y = silu_mul_rounded(y, acc_up, dtype)
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


class GemmConfig(NamedTuple):
    """One launch shape of `_gemm_kernel` (the sweep, `scripts/bench_projections.py --triton`, tries many)."""

    block_n: int
    block_m: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


SMEM_BUDGET = 192 * 1024  # bytes of pipelined tiles a program may hold (H100 / H200: 227 KB, less the epilogue's)
NUM_SMS = 132  # an H200's; the split rule aims for about one wave of programs


def gemm_config(m: int, n: int, k: int, element_size: int, silu_mul: bool = False) -> GemmConfig:
    """The launch shape for an [m, k] x [n, k]^T product (n output columns; with `silu_mul`, n = I of a [2I, k]
    weight): 64 weight rows x up to 128 tokens a tile, 128 bytes of K a chunk, and K split until the tiles
    fill about one wave of an H200's SMs (each split keeping at least 4 chunks).

    UNMEASURED: a guess for the first GPU sweep to replace."""
    block_n, block_m = 64, min(128, max(16, next_power_of_2(m)))
    block_k = max(16, min(next_power_of_2(k), 128 // element_size * 2))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = 1
    while tiles * split_k * 2 <= NUM_SMS and k // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return _fit_stages(GemmConfig(block_n, block_m, block_k, split_k, 4, 4), element_size, silu_mul)


def _fit_stages(cfg: GemmConfig, element_size: int, silu_mul: bool) -> GemmConfig:
    """`cfg` with its stages capped to what fits SMEM_BUDGET (a launch over the limit fails)."""
    stage_bytes = ((2 if silu_mul else 1) * cfg.block_n + cfg.block_m) * cfg.block_k * element_size
    return cfg._replace(num_stages=max(1, min(cfg.num_stages, SMEM_BUDGET // stage_bytes)))


def gemm_triton(
    x: torch.Tensor,  # [M, K] row stride any, last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous; with silu_mul [2N, K] (gate rows, then up rows)
    bias: Optional[torch.Tensor] = None,  # [N] / [2N]
    silu_mul: bool = False,
    counters: Optional[SplitCounters] = None,  # the kernel's zeroed counters between launches; None: per call
    config: Optional[GemmConfig] = None,  # None: gemm_config's rule
) -> torch.Tensor:  # [M, N] (N = weight rows, or half of them with silu_mul)
    """`F.linear(x, weight, bias)` (then `silu(gate) * up` with `silu_mul`) through `_gemm_kernel`."""
    m, k = x.shape
    n = weight.shape[0] // (2 if silu_mul else 1)
    cfg = config or gemm_config(m, n, k, weight.element_size(), silu_mul)
    cfg = _fit_stages(cfg, weight.element_size(), silu_mul)
    out = torch.empty(m, n, dtype=weight.dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    part, counter = out, out
    if cfg.split_k > 1:
        part = torch.empty(cfg.split_k * (2 if silu_mul else 1) * m * n, dtype=torch.float32, device=x.device)
        counter = counters.get(x.device, tiles) if counters is not None else None
        if counter is None:  # no shared buffer (or none big enough while a CUDA graph is captured): zeroed here
            counter = torch.zeros(tiles, dtype=torch.int32, device=x.device)
    _gemm_kernel[(tiles, cfg.split_k)](
        x, weight, bias if bias is not None else weight, out, part, counter,
        m, n, k, x.stride(0), k_per_split,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        NUM_STAGES=cfg.num_stages, UPCAST=interpreter_upcast(weight.dtype), HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, num_warps=cfg.num_warps,
    )
    return out
