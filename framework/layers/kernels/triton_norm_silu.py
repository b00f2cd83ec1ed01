"""RMSNorm (optionally fused with the residual add) and SiLU-and-mul in Triton, one launch each.

Semantics are `rms_norm_reference` and `silu_and_mul_reference` (framework/layers/kernels/layer_ops.py), including
where PyTorch rounds to the tensor dtype between ops (the residual sum, the normalised row before the weight
multiply, the SiLU before the product): each intermediate is rounded the same way here, so bfloat16 results
equal the reference bit for bit up to the last-ulp effects of a different summation order / `rsqrt` / `exp`.

Only model geometry (row length, dtype) is `constexpr`; the row count is the grid, never a kernel argument,
so CUDA-graph capture at many batch sizes compiles one variant per geometry. Row strides stay specialised:
they are fixed by the layout (a contiguous `[T, D]` row is `D` apart at every `T`), and their divisibility
by 16 is what lets the loads vectorise.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from framework.layers.kernels.pdl import pdl_launch_kwargs

MAX_RMS_NORM_DIM = 8192  # a whole row lives in registers; wider rows go to the reference (see layer_ops)


@triton.jit
def round_to_dtype(x, dtype):
    """float32 `x` rounded to `dtype` (nearest, ties to even, as PyTorch), returned as float32.

    bfloat16 is rounded on the bits: Triton's interpreter truncates float32 -> bfloat16 casts, so a plain
    `.to(tl.bfloat16)` would make the CPU tests disagree with the GPU (which rounds to nearest even); the
    result is exactly representable, so the final cast to bfloat16 is exact on both.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN (the carry could clear it)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


def interpreter_upcast(dtype: torch.dtype) -> bool:
    """True under Triton's interpreter for bfloat16, whose `tl.dot` multiplies the uint16 storage (numpy has no
    bfloat16; triton-lang/triton#11584): kernels then widen their `tl.dot` tiles to float32 (a constexpr UPCAST).
    That is exact (a bfloat16 product fits float32, and the GPU's bfloat16 MMA also accumulates in float32), so
    the CPU tests check the same arithmetic."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def prologue_input(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    x_offs,
    r_offs,
    g_offs,
    mask,
    g_mask,
    rstd,
    dtype,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """A chunk of a GEMV's input as the unfused ops round it, float32: `x`, `x + residual` (rounded to dtype),
    and with HAS_NORM `g * rmsnorm(...)` given the rows' `rstd` (normed row rounded, then its product with the
    norm weight `g`, as `_rms_norm_kernel`). Offsets, masks and `rstd` arrive broadcast to the chunk's layout
    (a row [BLOCK_K] in the GEMV); masked elements are 0."""
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + r_offs, mask=mask, other=0.0)
        x = round_to_dtype(x + r.to(tl.float32), dtype)
    if HAS_NORM:
        g = tl.load(norm_weight_ptr + g_offs, mask=g_mask, other=0.0).to(tl.float32)
        x = round_to_dtype(g * round_to_dtype(x * rstd, dtype), dtype)
    return x


@triton.jit
def prologue_rstd(
    x_ptr,
    residual_ptr,
    summed_ptr,
    M,
    stride_x,
    stride_r,
    eps,
    write_summed,
    dtype,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """[BLOCK_M] float32 `1 / rms(x + residual)` of the M input rows [M, K] (padding rows: rsqrt(eps), they
    multiply zeros); with `write_summed` (one program of the grid) also stores `x + residual` to summed_ptr
    [M, K] contiguous. The first pass of a GEMV's norm prologue: x is M x K, L2-resident."""
    rows_m = tl.arange(0, BLOCK_M)
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = (rows_m[:, None] < M) & (ks[None, :] < K)
        x = prologue_input(
            x_ptr,
            residual_ptr,
            x_ptr,
            rows_m[:, None] * stride_x + ks[None, :],
            rows_m[:, None] * stride_r + ks[None, :],
            ks,
            mask,
            mask,
            1.0,
            dtype,
            HAS_RESIDUAL,
            False,
        )
        if HAS_RESIDUAL:
            if write_summed:
                tl.store(summed_ptr + rows_m[:, None] * K + ks[None, :], x.to(dtype), mask=mask)
        sum_sq += tl.sum(x * x, axis=1)
    return tl.rsqrt(sum_sq / K + eps)


@triton.jit
def silu_mul_rounded(gate, up, dtype):
    """`silu(gate) * up` of float32 projection outputs, rounded as the unfused ops round (each projection output,
    the SiLU, the product)."""
    gate = round_to_dtype(gate, dtype)
    silu = round_to_dtype(gate / (1.0 + tl.exp(-gate)), dtype)
    return round_to_dtype(silu * round_to_dtype(up, dtype), dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, D], row stride stride_x, last dim contiguous
    residual_ptr,  # [T, D], row stride stride_r (x_ptr again when HAS_RESIDUAL is False; not read)
    weight_ptr,  # [D]
    out_ptr,  # [T, D] contiguous: weight * norm(x + residual)
    summed_ptr,  # [T, D] contiguous: x + residual (out_ptr again when HAS_RESIDUAL is False; not written)
    stride_x,
    stride_r,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= D
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (framework/layers/kernels/pdl.py)
    UNIT_OFFSET: tl.constexpr = False,  # (1 + weight) * norm in float32, rounded once (Gemma 3)
    FLOAT32_SCALE: tl.constexpr = False,  # weight * norm in float32, rounded once (Gemma 4)
):
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    if USE_PDL:  # x and the residual are the previous kernels' outputs
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to_dtype(x + r, dtype)  # the new residual stream is rounded to dtype before it is normalised
        tl.store(summed_ptr + row * D + cols, x.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)  # masked columns are 0: they add nothing
    if UNIT_OFFSET:  # HF's Gemma norms scale in float32 and round once
        out = (w + 1.0) * (x * rstd)
    elif FLOAT32_SCALE:
        out = w * (x * rstd)
    else:
        out = w * round_to_dtype(x * rstd, dtype)  # HF rounds the normalised row to dtype first, then * in dtype
    tl.store(out_ptr + row * D + cols, round_to_dtype(out, dtype).to(dtype), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [T, D] bf16/fp16/fp32, rows may be strided, last dim contiguous
    weight: torch.Tensor,  # [D], x.dtype
    eps: float,
    residual: Optional[torch.Tensor] = None,  # [T, D] x.dtype, last dim contiguous
    pdl: bool = False,  # programmatic dependent launch (only where `pdl.pdl_supported`)
    unit_offset: bool = False,  # scale by (1 + weight) in float32, rounded once (Gemma 3)
    float32_scale: bool = False,  # scale by weight in float32, rounded once (Gemma 4)
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight * rmsnorm(x + residual) [T, D], x + residual [T, D] or None), both new contiguous tensors."""
    num_rows, dim = x.shape
    assert x.stride(1) == 1 and weight.shape == (dim,) and weight.stride(0) == 1, "need contiguous rows and weight"
    assert weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x dtype {x.dtype}"
    assert dim <= MAX_RMS_NORM_DIM, f"rows of {dim} > {MAX_RMS_NORM_DIM} elements do not fit one program"
    out = torch.empty((num_rows, dim), dtype=x.dtype, device=x.device)
    summed = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        summed = torch.empty_like(out)
    if num_rows == 0:
        return out, summed
    block_d = next_power_of_2(dim)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        summed if summed is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        eps,
        D=dim,
        BLOCK_D=block_d,
        HAS_RESIDUAL=residual is not None,
        UNIT_OFFSET=unit_offset,
        FLOAT32_SCALE=float32_scale,
        num_warps=min(max(block_d // 256, 1), 16),  # ~8 elements per thread
        **pdl_launch_kwargs(pdl),
    )
    return out, summed


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2 * I], row stride stride_in: gate columns 0..I-1, up columns I..2I-1
    out_ptr,  # [T, I] contiguous
    stride_in,
    I: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + I + cols, mask=mask, other=0.0).to(tl.float32)
    silu = round_to_dtype(gate / (1.0 + tl.exp(-gate)), dtype)  # F.silu returns a dtype tensor
    tl.store(out_ptr + row * I + cols, round_to_dtype(silu * up, dtype).to(dtype), mask=mask)


def silu_and_mul_triton(
    gate_up: torch.Tensor,  # [T, 2 * I] bf16/fp16/fp32, last dim contiguous (a merged gate/up projection)
) -> torch.Tensor:
    """[T, I]: silu(gate_up[:, :I]) * gate_up[:, I:]."""
    num_rows, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(1) == 1, "need [T, 2 * I] with contiguous rows"
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block_i = min(next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(num_rows, cdiv(inter, block_i))](
        gate_up,
        out,
        gate_up.stride(0),
        I=inter,
        BLOCK_I=block_i,
        num_warps=4,
    )
    return out
