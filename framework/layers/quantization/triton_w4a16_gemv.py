"""Small-M GEMV of 4-bit integer weights and 16-bit activations (W4A16 decode, M = 1..16 rows), unpacking in registers.

The weight is the layout every INT4 format becomes after loading (`int4.py`, `triton_w4a16`): `qweight` int32
`[N, K / 8]` (column 8c + j in bits 4j..4j+3 of word c), float32 `scales` and `zeros` `[N, K / G]`, with
w[n, k] = scales[n, k // G] * (q[n, k] - zeros[n, k // G]). GPTQ act-order never reaches the kernel: the loader
sorts the input columns by group and the method permutes the activations (`Int4Method.apply`), so groups are
contiguous runs of G columns here.

Decode reads each weight byte once, a quarter of the bf16 bytes. The tensor-core GEMM of `triton_w4a16` loads one
int32 per weight element (the eight that share it come from L1) and reaches ~40 GB/s at M <= 16. Here, as in the
FP8 GEMV (`triton_w8a16_gemv`, whose launch rule this shares), a program owns `BLOCK_N` weight rows (a warp each)
and walks K in unrolled chunks of `BLOCK_K` columns, `BLOCK_K / 8` int32 words of each row: one 16-byte load a
lane, each word loaded once. The eight nibble planes of the words are shifted out and joined back innermost
(`_unpack_nibbles`), so each lane's 32 columns stay in its registers (no shared-memory layout change on the
weight); the chunk, seen as `[BLOCK_N, BLOCK_K / SUB_K, SUB_K]` (`SUB_K` columns sharing one group), gets its
group's zero point subtracted and scale applied in float32, and is multiplied with the M input rows one at a time
and reduced within the warp. Numerically `w4a16_linear_reference` up to the float32 summation order.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.quantization.triton_w8a16_gemv import (
    QUANT_GEMV_MAX_ROWS,
    UNROLL_ROWS,
    QuantGemvTiles,
    accumulate_rows,
    quant_gemv_tiles,
    shared_scale_span,
)


@triton.jit
def _unpack_nibbles(packed):
    """int32 [R, W] -> float32 [R, 8 W], column 8c + j = nibble j (bits 4j..4j+3) of word c. The eight nibble planes
    are joined innermost (the lowest bit of j last), so the flattening keeps each lane's words in its registers."""
    q0 = (packed & 0xF).to(tl.float32)
    q1 = ((packed >> 4) & 0xF).to(tl.float32)
    q2 = ((packed >> 8) & 0xF).to(tl.float32)
    q3 = ((packed >> 12) & 0xF).to(tl.float32)
    q4 = ((packed >> 16) & 0xF).to(tl.float32)
    q5 = ((packed >> 20) & 0xF).to(tl.float32)
    q6 = ((packed >> 24) & 0xF).to(tl.float32)
    q7 = ((packed >> 28) & 0xF).to(tl.float32)
    even = tl.join(tl.join(q0, q4), tl.join(q2, q6))  # [R, W, 2, 2]: [.., a, b] = q(4a + 2b)
    odd = tl.join(tl.join(q1, q5), tl.join(q3, q7))
    return tl.reshape(tl.join(even, odd), (packed.shape[0], packed.shape[1] * 8))  # [.., a, b, c] = q(4a + 2b + c)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K] activation dtype, row stride stride_x, last dim contiguous
    w_ptr,  # [N, K // 8] int32, contiguous
    s_ptr,  # [N, K // GROUP] float32, contiguous
    z_ptr,  # [N, K // GROUP] float32, contiguous
    b_ptr,  # [N] activation dtype (y_ptr when not HAS_BIAS; not read)
    y_ptr,  # [M, N] activation dtype, contiguous
    M,
    stride_x,
    N: tl.constexpr,
    K: tl.constexpr,
    GROUP: tl.constexpr,  # multiple of 8 dividing K
    SUB_K: tl.constexpr,  # power of two dividing BLOCK_K and GROUP (BLOCK_K when GROUP == K): columns of one group
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # power of two >= M
    UNROLL_M: tl.constexpr,  # BLOCK_M <= UNROLL_ROWS: the row loop unrolled (`accumulate_rows`)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # columns per chunk (BLOCK_K / 8 int32 words), a multiple of 8
):
    pid = tl.program_id(0)
    KW: tl.constexpr = K // 8
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    NUM_GROUPS: tl.constexpr = K // GROUP
    NG: tl.constexpr = BLOCK_K // SUB_K
    rows_m = tl.arange(0, BLOCK_M)
    rows_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows_n < N
    w_rows = rows_n.to(tl.int64)[:, None] * KW
    g_rows = rows_n[:, None] * NUM_GROUPS  # [BLOCK_N, 1] offset of each row's scales / zeros
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # [n, m]: the row sums' own layout, no conversion
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: later chunks' loads issue before this chunk's sums
        words = k0 // 8 + tl.arange(0, BLOCK_W)
        w_mask = n_mask[:, None] & (words < KW)[None, :]
        packed = tl.load(w_ptr + w_rows + words[None, :], mask=w_mask, other=0)  # [BLOCK_N, BLOCK_W] int32
        groups = (k0 + tl.arange(0, NG) * SUB_K) // GROUP  # [NG] group of each SUB_K columns
        g_mask = n_mask[:, None] & (groups < NUM_GROUPS)[None, :]
        scale = tl.load(s_ptr + g_rows + groups[None, :], mask=g_mask, other=0.0)[:, :, None]  # [BLOCK_N, NG, 1]
        zero = tl.load(z_ptr + g_rows + groups[None, :], mask=g_mask, other=0.0)[:, :, None]
        q = tl.reshape(_unpack_nibbles(packed), (BLOCK_N, NG, SUB_K))  # values 0..15
        w = tl.reshape((q - zero) * scale, (BLOCK_N, BLOCK_K))  # [BLOCK_N, BLOCK_K] float32, 0 past K and N
        ks = k0 + tl.arange(0, BLOCK_K)
        acc = accumulate_rows(acc, w, x_ptr, stride_x, ks, ks < K, M, UNROLL_M)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_mask = n_mask[:, None] & (rows_m[None, :] < M)
    tl.store(y_ptr + rows_m[None, :] * N + rows_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def w4a16_gemv_triton(
    x: torch.Tensor,  # [M, K] activation dtype, M <= QUANT_GEMV_MAX_ROWS, last dim contiguous
    qweight: torch.Tensor,  # [N, K / 8] int32, contiguous
    scales: torch.Tensor,  # [N, K / G] float32, contiguous
    zeros: torch.Tensor,  # [N, K / G] float32, contiguous
    group: int,  # G: a multiple of 8 dividing K
    bias: Optional[torch.Tensor] = None,  # [N] activation dtype
    tiles: Optional[QuantGemvTiles] = None,  # default `quant_gemv_tiles(M, N, K, column_bits=4)`
) -> torch.Tensor:  # [M, N] in x's dtype
    """The GEMV; same semantics as `triton_w4a16.w4a16_linear_reference` (float32 summation order aside). No host
    sync and a fixed-shape output, so CUDA graphs capture it."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= QUANT_GEMV_MAX_ROWS, f"{m} rows > {QUANT_GEMV_MAX_ROWS}: use w4a16_linear_triton"
    assert qweight.shape == (n, k // 8) and qweight.dtype == torch.int32 and qweight.is_contiguous()
    assert k % group == 0 and group % 8 == 0, f"group {group}: a multiple of 8 dividing K = {k}"
    assert scales.shape == zeros.shape == (n, k // group) and scales.is_contiguous() and zeros.is_contiguous()
    assert x.stride(-1) == 1 and (bias is None or bias.shape == (n,))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    tiles = tiles or quant_gemv_tiles(m, n, k, column_bits=4)
    assert tiles.block_m >= m and tiles.grid * tiles.block_n >= n and tiles.block_k >= 8, f"{tiles}: [{m}, {n}]"
    _w4a16_gemv_kernel[(tiles.grid,)](
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else y,
        y,
        m,
        x.stride(0),
        N=n,
        K=k,
        GROUP=group,
        SUB_K=shared_scale_span(group, k, tiles.block_k),
        HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m,
        UNROLL_M=tiles.block_m <= UNROLL_ROWS,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
    )
    return y
