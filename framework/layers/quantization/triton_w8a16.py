"""FP8-weight x 16-bit-activation matmul (W8A16) with group scales, dequantizing the weight in registers.

One kernel serves every FP8 weight layout mrv2 reads: the weight is FP8 e4m3 `[N, K]`, its scales a float32
`[ceil(N / group_n), ceil(K / group_k)]` grid (one scale per `group_n x group_k` tile of the weight):

    FP8 block (128 x 128 tiles)     group_n = 128, group_k = 128
    per output channel               group_n = 1,   group_k = K
    per tensor                       group_n = N,   group_k = K

A program owns a `BLOCK_M x BLOCK_N` output tile and walks K in `BLOCK_K` chunks, each inside one scale group
(`BLOCK_K` divides `group_k`): the chunk's FP8 weights widen to the activation dtype (exactly: every e4m3 value is
a bf16 / fp16 / fp32 value), one tensor-core product accumulates in float32, and the chunk's partial sums are
multiplied by their output channels' scales before they are added, so the scale costs one multiply per output
per chunk, not one per weight. Activations are not quantized: numerically this is the dequantized weight's
matmul with a float32 accumulator, which is what the reference computes.

Decode (M <= 16) reads each weight byte once with narrow `BLOCK_N` tiles so that enough programs stream the weight
in parallel (half the bytes of the bf16 projection); prefill uses 128-wide tiles.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv


@triton.jit
def _w8a16_gemm_kernel(
    x_ptr,  # [M, K] activation dtype, last dim contiguous
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    s_ptr,  # [SN, SK] float32, contiguous: the scale of weight tile (n // GROUP_N, k // GROUP_K)
    b_ptr,  # [N] activation dtype (read only when HAS_BIAS)
    y_ptr,  # [M, N] activation dtype, contiguous
    M,
    N,
    K,
    stride_xm,
    stride_sn,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_IEEE: tl.constexpr,  # float32 activations: exact float32 products, not TF32
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
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    s_rows = s_ptr + (offs_n // GROUP_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        scale = tl.load(s_rows + k0 // GROUP_K, mask=mask_n, other=0.0)  # one group per chunk
        if DOT_IEEE:
            partial = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
        else:
            partial = tl.dot(x, tl.trans(w.to(x.dtype)))
        acc += partial * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def expand_scales(scale: torch.Tensor, n: int, k: int, group_n: int, group_k: int) -> torch.Tensor:
    """[SN, SK] group scales -> [N, K]: each weight element's scale."""
    return scale.repeat_interleave(group_n, 0)[:n].repeat_interleave(group_k, 1)[:, :k]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int) -> torch.Tensor:
    """FP8 weight [N, K] and its group scales [SN, SK] -> float32 [N, K]."""
    n, k = weight.shape
    return weight.float() * expand_scales(scale.float(), n, k, group_n, group_k)


def w8a16_linear_reference(
    x: torch.Tensor,  # [M, K] activation dtype
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / group_n), ceil(K / group_k)] float32
    group_n: int,
    group_k: int,
    bias: Optional[torch.Tensor] = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ dequantize(weight)^T + bias, computed in float32 and rounded once to x's dtype."""
    y = x.float() @ dequantize_fp8(weight, scale, group_n, group_k).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _block_k(k: int, group_k: int) -> int:
    """The widest K chunk (<= 128) that stays inside one scale group."""
    for block in (128, 64, 32, 16):
        if group_k % block == 0 or group_k >= k:
            return block
    raise ValueError(f"group_k={group_k} is not a multiple of 16")


def w8a16_linear_triton(
    x: torch.Tensor,  # [M, K] activation dtype (bf16 / fp16 / fp32), last dim contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor,  # [ceil(N / group_n), ceil(K / group_k)] float32, contiguous
    group_n: int,
    group_k: int,
    bias: Optional[torch.Tensor] = None,  # [N] activation dtype
) -> torch.Tensor:  # [M, N] in x's dtype
    """The kernel; same semantics as `w8a16_linear_reference` (float32 summation order aside)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.dtype == torch.float8_e4m3fn and weight.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (cdiv(n, group_n), cdiv(k, group_k))
    assert x.stride(-1) == 1
    scale = scale.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if m <= 16:  # decode: weight-bandwidth bound, many narrow programs
        block_m, block_n, warps, stages = 16, 32, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 4
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    block_k = _block_k(k, group_k)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _w8a16_gemm_kernel[grid](
        x,
        weight,
        scale,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        x.stride(0),
        scale.stride(0),
        GROUP_N=group_n,
        GROUP_K=group_k,
        HAS_BIAS=bias is not None,
        DOT_IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return y
