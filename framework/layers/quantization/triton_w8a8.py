"""FP8 x FP8 matmul (W8A8) with group scales on both operands, and the dynamic FP8 quantization of activations.

For FP8 checkpoints at large M (prefill, big batches), the activations are quantized to FP8 e4m3 as the checkpoint
declares and both operands go to the tensor cores in FP8 (twice the bf16 rate on Hopper):

    checkpoint                        activation scales (`sx`, float32)       weight scales (`triton_w8a16`'s grid)
    FP8 block (HF "fp8", dynamic)     per token and 128-input group [M, K/128]  per 128 x 128 tile
    c-t FP8_DYNAMIC                   per token [M, 1]                          per output channel
    c-t FP8 (static)                  the checkpoint's `input_scale` [1, 1]     per tensor

`quantize_fp8_groups` computes dynamic scales: each group's largest magnitude maps to 448 (an all-zero group gets
scale 1), values are divided by the scale and rounded to e4m3. A static scale divides and clamps to +-448.

`_w8a8_gemm_kernel`: a program owns a `BLOCK_M x BLOCK_N` output tile and walks K in `BLOCK_K` chunks, each inside
one activation group and one weight group (`BLOCK_K` divides both), so a chunk's FP8 x FP8 product (float32
accumulation) is multiplied by `sx[m, chunk] * sw[n, chunk]` before it is added. Semantics (the reference): the
dequantized activations times the dequantized weights, float32 accumulation, rounded once to the output dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from framework.layers.quantization.base import FP8_DTYPE, FP8_MAX
from framework.layers.quantization.triton_w8a16 import dequantize_fp8


@triton.jit
def _quant_fp8_groups_kernel(
    x_ptr,  # [M, K] 16/32-bit, row stride stride_xm, last dim contiguous
    q_ptr,  # [M, K] out: float8_e4m3fn, contiguous
    s_ptr,  # [M, K // GROUP] out: float32 scales, contiguous
    K,
    stride_xm,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,  # the power of two >= GROUP (per token over a K of 768 or 12288: a masked tail)
):
    row = tl.program_id(0)
    group = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = group * GROUP + offs
    mask = (offs < GROUP) & (cols < K)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(q_ptr + row.to(tl.int64) * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row.to(tl.int64) * tl.cdiv(K, GROUP) + group, scale)


def quantize_fp8_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]): dynamic per-token-group quantization."""
    m, k = x.shape
    groups = cdiv(k, group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    amax = padded.view(m, groups, group).abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded.view(m, groups, group) / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return q.to(FP8_DTYPE), scale


def quantize_fp8_groups(x: torch.Tensor, group: int, use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_groups_reference` by the Triton kernel (`use_kernel`) or the reference."""
    m, k = x.shape
    if not use_kernel or x.stride(-1) != 1:
        return quantize_fp8_groups_reference(x, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, cdiv(k, group)), dtype=torch.float32, device=x.device)
    if m:
        group = min(group, k)  # one program per group; the scales' shape is the same
        block = next_power_of_2(group)
        _quant_fp8_groups_kernel[(m, cdiv(k, group))](x, q, s, k, x.stride(0), GROUP=group, BLOCK=block)
    return q, s


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] and a checkpoint's per-tensor `input_scale` [1] -> (e4m3 [M, K], scale [1, 1])."""
    s = scale.float().reshape(1, 1)
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


@triton.jit
def _w8a8_gemm_kernel(
    x_ptr,  # [M, K] float8_e4m3fn, contiguous
    sx_ptr,  # [M or 1, SKX] float32 activation scales (row stride stride_sxm: 0 for one scale for all rows)
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    sw_ptr,  # [SN, SK] float32 weight scales, contiguous
    b_ptr,  # [N] (read only when HAS_BIAS)
    y_ptr,  # [M, N] out, contiguous
    M,
    N,
    K,
    stride_sxm,
    stride_sxk,  # 0 when one activation scale spans every K (per token, per tensor)
    stride_sn,
    GROUP_X: tl.constexpr,  # activation group along K
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: FP8 tiles go to tl.dot as float32 (exact products)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * K
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    sx_rows = sx_ptr + offs_m * stride_sxm
    sw_rows = sw_ptr + (offs_n // GROUP_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        sx = tl.load(sx_rows + (k0 // GROUP_X) * stride_sxk, mask=mask_m, other=0.0)
        sw = tl.load(sw_rows + k0 // GROUP_K, mask=mask_n, other=0.0)
        if UPCAST:
            partial = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            partial = tl.dot(x, tl.trans(w))
        acc += partial * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w8a8_linear_reference(
    xq: torch.Tensor,  # [M, K] float8_e4m3fn
    sx: torch.Tensor,  # [M or 1, ceil(K / group_x)] float32
    group_x: int,
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    sw: torch.Tensor,  # [ceil(N / group_n), ceil(K / group_k)] float32
    group_n: int,
    group_k: int,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:  # [M, N] out_dtype
    """dequantize(xq) @ dequantize(weight)^T + bias in float32, rounded once."""
    m, k = xq.shape
    x = dequantize_fp8(xq, sx.expand(m, -1), 1, group_x)
    y = x @ dequantize_fp8(weight, sw, group_n, group_k).t()
    return (y if bias is None else y + bias.float()).to(out_dtype)


def w8a8_block_k(k: int, *groups: int) -> int:
    """The widest K chunk (<= 128) inside one group of each operand."""
    for block in (128, 64, 32, 16):
        if all(g % block == 0 or g >= k for g in groups):
            return block
    raise ValueError(f"w8a8: groups {groups} are not multiples of 16")


def w8a8_linear_triton(
    xq: torch.Tensor,  # [M, K] float8_e4m3fn, contiguous
    sx: torch.Tensor,  # [M or 1, ceil(K / group_x)] float32, contiguous
    group_x: int,
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    sw: torch.Tensor,  # [SN, SK] float32, contiguous
    group_n: int,
    group_k: int,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    upcast: bool = False,  # under the interpreter (numpy has no FP8 product)
) -> torch.Tensor:  # [M, N] out_dtype
    """The kernel; same semantics as `w8a8_linear_reference` (float32 summation order aside)."""
    m, k = xq.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    block_m, block_n, warps, stages = (64, 128, 4, 4) if m <= 256 else (128, 128, 8, 3)
    _w8a8_gemm_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
        xq,
        sx,
        weight,
        sw,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        sx.stride(0) if sx.shape[0] == m and m > 1 else 0,
        sx.stride(1) if sx.shape[1] > 1 else 0,
        sw.stride(0),
        GROUP_X=min(group_x, k),
        GROUP_N=group_n,
        GROUP_K=min(group_k, k),
        HAS_BIAS=bias is not None,
        UPCAST=upcast,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=w8a8_block_k(k, group_x, group_k),
        num_warps=warps,
        num_stages=stages,
    )
    return y
