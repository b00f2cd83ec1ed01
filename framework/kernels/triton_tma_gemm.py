"""Decode projections at 32-256 tokens through Hopper's tensor memory accelerator: a swap-AB GEMM fed by TMA.

The Qwen3-8B geometry's decode at 65-128 rows spends 55 % of its time in the four cuBLAS projections a layer,
at ~3.3 TB/s of weight bytes (docs/benchmarks.md, issue 25); a step at that batch is bound by the weights, not
the FLOPs. This kernel streams each weight tile through TMA (`TensorDescriptor` loads: one instruction per tile,
no address arithmetic in the threads) with a software-pipelined K loop, so several weight tiles are in flight
per SM. As in the small-batch dot kernel (`triton_gemv_dot.py`) the weight rows are the MMA's m dimension and
the tokens its n: out^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, K] @ x^T [K, BLOCK_M]. K may be split over
`split_k` programs per output tile (the last split to finish sums the float32 partials in split order, as the
earlier split-K experiment did: the result does not depend on arrival order). With `silu_mul` the weight is
[2N, K] (gate rows, then up rows) and the epilogue applies SiLU(gate) * up with `silu_and_mul`'s rounding points.

Semantics: `F.linear` (float32 accumulation, rounded to the weight dtype), the summation order a GEMM's own.
TMA needs 16-byte aligned base pointers and row strides; `tma_gemm_takes` says whether a pair qualifies.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from framework.kernels.triton_norm_silu import interpreter_upcast, round_to_dtype, silu_mul_rounded


@triton.jit
def _k_loop(w_desc, x_desc, row_w, row_x, k_lo, k_hi, acc, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
            UPCAST: tl.constexpr):
    """acc + W[row_w : row_w + BLOCK_N, k_lo:k_hi] @ x[row_x : row_x + BLOCK_M, k_lo:k_hi]^T."""
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([row_w, k0])  # [BLOCK_N, BLOCK_K]; rows or columns past the tensor read as zeros
        x = x_desc.load([row_x, k0])  # [BLOCK_M, BLOCK_K]
        if UPCAST:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)
    return acc


@triton.jit(do_not_specialize=["M"])  # per-step size: every M of a tile shape shares one variant
def _tma_gemm_kernel(
    w_desc,  # [N, K] (with SILU_MUL [2N, K]) in [BLOCK_N, BLOCK_K] boxes
    x_desc,  # [M, K] in [BLOCK_M, BLOCK_K] boxes
    out_ptr,  # [M, N] contiguous
    part_ptr,  # [SPLIT_K, PARTS, M, N] float32 (PARTS = 2 with SILU_MUL); out_ptr when SPLIT_K == 1, not used
    counter_ptr,  # [tiles] int32 zeros (SPLIT_K > 1): finished splits per output tile, reset by the last one
    M, N, K, k_per_split,
    BLOCK_N: tl.constexpr,  # weight rows per program: the MMA's m dimension
    BLOCK_M: tl.constexpr,  # tokens per program: the MMA's n dimension
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: bfloat16 tiles go to tl.dot as float32
    SILU_MUL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    tile = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile // tiles_n, tile % tiles_n  # neighbours share a token tile: x is read from L2
    dtype = out_ptr.dtype.element_ty
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = _k_loop(w_desc, x_desc, pid_n * BLOCK_N, pid_m * BLOCK_M, k_lo, k_hi,
                  tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), BLOCK_K, NUM_STAGES, UPCAST)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SILU_MUL:
        acc_up = _k_loop(w_desc, x_desc, N + pid_n * BLOCK_N, pid_m * BLOCK_M, k_lo, k_hi, acc_up,
                         BLOCK_K, NUM_STAGES, UPCAST)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_offs = rows_m[None, :] * N + cols_n[:, None]  # [BLOCK_N, BLOCK_M]: an out^T tile
    out_mask = (cols_n < N)[:, None] & (rows_m < M)[None, :]
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
        y = round_to_dtype(acc, dtype)
        if SILU_MUL:
            y = silu_mul_rounded(y, acc_up, dtype)
        tl.store(out_ptr + out_offs, y, mask=out_mask)


class TmaGemmConfig(NamedTuple):
    """One launch shape of `_tma_gemm_kernel`."""

    block_n: int
    block_m: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


NUM_SMS = 132  # an H200's; the split rule aims for at least one wave of programs


def tma_gemm_config(m: int, n: int, k: int) -> TmaGemmConfig:
    """The launch shape for an [m, k] x [n, k]^T product (n = output columns): 128 weight rows x up to 128 tokens
    a tile, 64-element K boxes (128 bytes of bf16: one swizzled TMA row), and K split while the tiles fill less
    than one wave of SMs (each split keeping at least 8 boxes). UNMEASURED: the first GPU sweep replaces it."""
    block_n, block_m, block_k = 128, min(128, max(16, triton.next_power_of_2(m))), 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = 1
    while tiles * split_k < NUM_SMS and k // (split_k * 2) >= 8 * block_k:
        split_k *= 2
    return TmaGemmConfig(block_n, block_m, block_k, split_k, 4, 4)


def tma_gemm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether TMA can read `x` and `weight` as they are: 2-D, last dim contiguous, 16-byte aligned base and rows,
    a 16- or 32-bit float dtype the two share."""
    def aligned(t: torch.Tensor) -> bool:
        return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
                and (t.stride(0) * t.element_size()) % 16 == 0)

    return (x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and aligned(x)
            and aligned(weight))


def tma_gemm(
    x: torch.Tensor,  # [M, K] last dim contiguous, 16-byte aligned rows
    weight: torch.Tensor,  # [N, K] contiguous; with silu_mul [2N, K] (gate rows, then up rows)
    silu_mul: bool = False,
    config: Optional[TmaGemmConfig] = None,  # None: tma_gemm_config's rule
    counters: Optional[torch.Tensor] = None,  # int32 zeros, >= the launch's tiles (split_k > 1); None: per call
    pdl: bool = False,
) -> torch.Tensor:  # [M, N] (N = weight rows, or half of them with silu_mul)
    """`F.linear(x, weight)` (then `silu(gate) * up` with `silu_mul`) through `_tma_gemm_kernel`."""
    m, k = x.shape
    n = weight.shape[0] // (2 if silu_mul else 1)
    cfg = config or tma_gemm_config(m, n, k)
    out = torch.empty(m, n, dtype=weight.dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    part, counter = out, out
    if cfg.split_k > 1:
        part = torch.empty(cfg.split_k * (2 if silu_mul else 1) * m * n, dtype=torch.float32, device=x.device)
        counter = counters if counters is not None else torch.zeros(tiles, dtype=torch.int32, device=x.device)
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    extra = {"USE_PDL": True, "launch_pdl": True} if pdl else {}
    _tma_gemm_kernel[(tiles, cfg.split_k)](
        w_desc, x_desc, out, part, counter, m, n, k, k_per_split,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        NUM_STAGES=cfg.num_stages, UPCAST=interpreter_upcast(weight.dtype), SILU_MUL=silu_mul,
        num_warps=cfg.num_warps, **extra,
    )
    return out
