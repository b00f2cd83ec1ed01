"""4-bit-integer-weight x 16-bit-activation matmul (W4A16) with group scales and zero points, unpacking in registers.

The weight is the layout every INT4 format becomes after loading (`int4.py`): `qweight` int32 `[N, K / 8]` holding
eight 4-bit values of consecutive input columns (column 8c + j in bits 4j..4j+3), float32 `scales` and `zeros`
`[N, K / G]`, so that w[n, k] = scales[n, k // G] * (q[n, k] - zeros[n, k // G]).

A program owns a `BLOCK_M x BLOCK_N` output tile and walks K in `BLOCK_K` chunks inside one group (`BLOCK_K`
divides G): the chunk's packed words are loaded once as a contiguous `[BLOCK_N, BLOCK_K / 8]` int32 tile (not one
word per element: that gather read each word eight times and could not be vectorised) and spread to
`[BLOCK_N, BLOCK_K]` in the registers of the threads that loaded them (`nibbles.spread_int4_words`). The zero point
is subtracted in integers (every loader's zero points are integers, at most 16) and `q - zero` converts exactly to
bf16 / fp16; one tensor-core product accumulates in float32 and the chunk's partial sums are then scaled per output
channel. So the kernel computes the dequantized weight's product up to float32 summation order, like the
reference. Decode reads a quarter of the bf16 weight bytes.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv
from framework.layers.kernels.nibbles import spread_int4_words


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,  # [M, K] activation dtype, last dim contiguous
    w_ptr,  # [N, K // 8] int32, contiguous
    s_ptr,  # [N, K // GROUP] float32, contiguous
    z_ptr,  # [N, K // GROUP] float32, contiguous
    b_ptr,  # [N] (read only when HAS_BIAS)
    y_ptr,  # [M, N] activation dtype, contiguous
    M,
    N,
    K,
    stride_xm,
    GROUP: tl.constexpr,
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
    offs_c = tl.arange(0, BLOCK_K // 8)  # the chunk's int32 words
    mask_m = offs_m < M
    mask_n = offs_n < N
    num_groups = K // GROUP
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * (K // 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of GROUP, hence of BLOCK_K: no partial chunk
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
        packed = tl.load(w_rows + (k0 // 8 + offs_c)[None, :], mask=mask_n[:, None], other=0)  # [BLOCK_N, BLOCK_K / 8]
        # Each word read once, its eight nibbles spread in the registers of the thread that loaded it.
        q = spread_int4_words(packed, BLOCK_N, BLOCK_K)
        group = k0 // GROUP
        zero = tl.load(z_ptr + offs_n * num_groups + group, mask=mask_n, other=0.0).to(tl.int32)  # integral
        scale = tl.load(s_ptr + offs_n * num_groups + group, mask=mask_n, other=0.0)
        w = (q - zero[:, None]).to(x.dtype)  # exact: |q - z| <= 16
        if DOT_IEEE:
            partial = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            partial = tl.dot(x, tl.trans(w))
        acc += partial * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 8] -> uint8 [N, K]: value of column 8c + j from bits 4j..4j+3 of qweight[:, c]."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    return ((qweight.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).reshape(qweight.shape[0], -1)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 (K a multiple of 8) -> int32 [N, K / 8], the inverse of `unpack_rows`."""
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    packed = (q.long().reshape(q.shape[0], -1, 8) << shifts).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def w4a16_linear_reference(
    x: torch.Tensor,  # [M, K] activation dtype
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, K / G] float32
    zeros: torch.Tensor,  # [N, K / G] float32
    group: int,
    bias: Optional[torch.Tensor] = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ W^T + bias with w[n, k] = scales[n, k // G] * (q[n, k] - zeros[n, k // G]), in float32, rounded once."""
    q = unpack_rows(qweight).float()
    weight = scales.repeat_interleave(group, 1) * (q - zeros.repeat_interleave(group, 1))
    y = x.float() @ weight.t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def w4a16_linear_triton(
    x: torch.Tensor,  # [M, K] activation dtype, last dim contiguous
    qweight: torch.Tensor,  # [N, K / 8] int32, contiguous
    scales: torch.Tensor,  # [N, K / G] float32, contiguous
    zeros: torch.Tensor,  # [N, K / G] float32, contiguous
    group: int,  # G: a multiple of 16 dividing K
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """The kernel; same semantics as `w4a16_linear_reference` (float32 summation order aside)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape == (n, k // 8) and qweight.dtype == torch.int32 and k % group == 0 and group % 16 == 0
    assert scales.shape == zeros.shape == (n, k // group) and x.stride(-1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if m <= 16:
        block_m, block_n, warps, stages = 16, 32, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 4
    else:  # 128x128 tiles: K chunks of at most 64 keep 3 stages inside Hopper's 227 KiB of shared memory
        block_m, block_n, warps, stages = 128, 128, 8, 3
    max_k = 64 if block_m == 128 else 128
    block_k = next(b for b in (128, 64, 32, 16) if group % b == 0 and b <= max_k)
    _w4a16_gemm_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        x.stride(0),
        GROUP=group,
        HAS_BIAS=bias is not None,
        DOT_IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return y
