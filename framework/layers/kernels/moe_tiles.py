"""Triton pieces of the fused MoE kernels (`fused_moe.py`, `triton_moe_w8a8.py`): a block's rows, weight tiles, the
dequantizing dot, the epilogues.

Weight tiles (`QUANT`, a constexpr of the kernels): 0 the activation dtype, 1 FP8 e4m3 with group scales, 2 int32
words of eight 4-bit values with group scales and zero points (`_int4_weight_tile`: zero points subtracted in
integers, scales after the dot, `_dot_expert_tile`), 3 MXFP4 (`_mxfp4_weight_tile`: bytes of two FP4 e2m1 values, an
E8M0 power-of-two scale per 32 inputs, dequantized in registers before the dot, which is exact in bfloat16 and
float32). The 4-bit tiles load a K chunk's packed words or bytes once, contiguous along K, and spread the nibbles in
registers (a gather of one word per element read each word eight times and could not be vectorised).

Epilogues (constexprs `ACTIVATION`, `HAS_BIAS`; semantics and references in `moe_epilogue.py`): per-expert biases
added to the gate/up and down products, and the activation: SiLU-and-mul (0) or gpt-oss's clamped SwiGLU (1).
Every intermediate is rounded to the activation dtype where the PyTorch reference rounds it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from framework.layers.kernels.nibbles import spread_fp4_bytes, spread_int4_words
from framework.layers.kernels.triton_norm_silu import round_to_dtype


@triton.jit
def _moe_row_block(
    sorted_rows_ptr,  # [P] int32 rows grouped by expert (moe_align); num_rows marks padding
    block_expert_ptr,  # [P // BLOCK_M] int32
    num_rows,  # M * K
    pid_m,
    pid_n,
    N: tl.constexpr,  # output columns of the GEMM
    TOP_K: tl.constexpr,  # 1: `tokens` are the rows themselves
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(rows [BLOCK_M], valid, tokens (int64, 0 for padding), expert (int64), cols [BLOCK_N], col_mask) of the
    program's block of sorted (token, choice) rows and tile of output columns."""
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    tokens = tl.where(valid, rows // TOP_K, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, valid, tokens, expert, cols, cols < N


@triton.jit
def _expert_weight_tile(w_ptr, base, rows, ks, K: tl.constexpr, mask, QUANT: tl.constexpr):
    """[BLOCK_K, BLOCK_N] raw values of W[rows, ks]^T for one expert matrix of K inputs per row starting at `base`
    (elements of the activation dtype or FP8; 4-bit formats have their own tiles below)."""
    return tl.load(w_ptr + base + rows[None, :] * K + ks[:, None], mask=mask, other=0.0)


@triton.jit
def _int4_weight_tile(
    w_ptr, z_ptr, base, zero_base, rows, row_mask, k0, K: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_COLS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """[BLOCK_K, BLOCK_N] int32 q - zero of W[rows, k0 : k0 + BLOCK_K]^T: int32 words [N, K / 8] at `base` (input
    8c + j in bits 4j..4j+3 of word c), integral zero points [N, SCALE_COLS] at `zero_base` (the chunk lies in one
    group). The chunk's words are loaded once, [BLOCK_N, BLOCK_K / 8] contiguous along K, and their nibbles spread in
    registers (`nibbles.spread_int4_words`)."""
    block_n: tl.constexpr = rows.shape[0]
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = row_mask[:, None] & (words < K // 8)[None, :]
    packed = tl.load(w_ptr + base + rows[:, None] * (K // 8) + words[None, :], mask=mask, other=0)
    q = spread_int4_words(packed, block_n, BLOCK_K)
    zero = tl.load(z_ptr + zero_base + rows * SCALE_COLS + k0 // GROUP_K, mask=row_mask, other=0.0).to(tl.int32)
    return tl.trans(q - zero[:, None])  # |q - z| <= 16: exact in every activation dtype


@triton.jit
def _mxfp4_weight_tile(
    w_ptr, s_ptr, base, scale_base, rows, row_mask, k0, K: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """[BLOCK_K, BLOCK_N] float32 W[rows, k0 : k0 + BLOCK_K]^T of one MXFP4 expert matrix: bytes [N, K / 2] at
    `base` (input 2c in the low nibble of byte c, 2c + 1 in the high one), E8M0 exponents [N, K / 32] at
    `scale_base`; an element is e2m1(code) * 2^(exponent - 127) (exponent 0 reads as 0, not 2^-127). BLOCK_K is a
    multiple of 32: the chunk's bytes ([BLOCK_N, BLOCK_K / 2]) and exponents ([BLOCK_N, BLOCK_K / 32]) are loaded
    once each, contiguous along K, and spread in registers (`nibbles.spread_fp4_bytes`)."""
    block_n: tl.constexpr = rows.shape[0]
    offs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = row_mask[:, None] & (offs < K // 2)[None, :]
    packed = tl.load(w_ptr + base + rows[:, None] * (K // 2) + offs[None, :], mask=mask, other=0).to(tl.int32)
    code = tl.reshape(spread_fp4_bytes(packed, block_n, BLOCK_K), (block_n, BLOCK_K // 32, 32))
    exponent = (code >> 1) & 3
    mantissa = code & 1
    # e2m1: 0, 0.5 (subnormal), else 2^(e - 1) * (1 + m / 2) = ((2 + m) << e) / 4
    normal = ((2 + mantissa) << exponent).to(tl.float32) * 0.25
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    value = tl.where(code >= 8, -magnitude, magnitude)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale_mask = row_mask[:, None] & (groups < K // 32)[None, :]
    offs_s = scale_base + rows[:, None] * (K // 32) + groups[None, :]
    biased = tl.load(s_ptr + offs_s, mask=scale_mask, other=127).to(tl.int32)
    power = (biased << 23).to(tl.float32, bitcast=True)  # 2^(biased - 127) built from its float32 bits
    return tl.trans(tl.reshape(value * power[:, :, None], (block_n, BLOCK_K)))


@triton.jit
def _dot_expert_tile(
    acc,  # [BLOCK_M, BLOCK_N] float32
    a,  # [BLOCK_M, BLOCK_K] activations
    w,  # [BLOCK_K, BLOCK_N] weight tile (QUANT 0, 1: raw; 2: int32 q - zero; 3: dequantized float32)
    s_ptr,  # scale grid of the expert matrix, [SCALE_ROWS, SCALE_COLS] float32 at `scale_base` (QUANT 1, 2)
    scale_base,
    rows,  # [BLOCK_N] output rows of the tile
    row_mask,
    k0,  # first input of the chunk; the chunk lies inside one input group (BLOCK_K divides GROUP_K)
    QUANT: tl.constexpr,  # module docstring
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """acc + a @ dequantize(w): the chunk's FP8 values or int4 `q - zero` (`_int4_weight_tile`) widen exactly to the
    activation dtype, one tensor-core product, then each output row's group scale multiplies the partial sums.
    MXFP4 tiles arrive dequantized (a power of two times an e2m1 value: exact in the activation dtype)."""
    if QUANT == 1:
        w = w.to(tl.float32)  # e4m3 widens through float32
    if UPCAST:
        a, w = a.to(tl.float32), w.to(tl.float32)
    else:
        w = w.to(a.dtype)
    if QUANT == 0 or QUANT == 3:
        return tl.dot(a, w, acc, input_precision=PRECISION)
    else:
        offs = scale_base + (rows // GROUP_N) * SCALE_COLS + k0 // GROUP_K
        scale = tl.load(s_ptr + offs, mask=row_mask, other=0.0)
        return acc + tl.dot(a, w, input_precision=PRECISION) * scale[None, :]


@triton.jit
def _gate_up_epilogue(
    acc_gate,  # [BLOCK_M, BLOCK_N] float32
    acc_up,
    b_ptr,  # HAS_BIAS: [E, 2, I] gate/up biases (any float dtype)
    expert,
    cols,  # [BLOCK_N] intermediate columns of the tile
    col_mask,
    I: tl.constexpr,
    dtype: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU; 2: gelu_tanh(gate) * up
    HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] float32 holding dtype values: the activation of the rounded (biased) projections."""
    gate = round_to_dtype(acc_gate, dtype)
    up = round_to_dtype(acc_up, dtype)
    if HAS_BIAS:
        bias = b_ptr + expert * (2 * I) + cols
        gate = round_to_dtype(gate + tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)[None, :], dtype)
        up = round_to_dtype(up + tl.load(bias + I, mask=col_mask, other=0.0).to(tl.float32)[None, :], dtype)
    if ACTIVATION == 0:
        silu = round_to_dtype(gate / (1.0 + tl.exp(-gate)), dtype)
        return round_to_dtype(silu * up, dtype)
    elif ACTIVATION == 2:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        gelu = round_to_dtype(gate / (1.0 + tl.exp(-2.0 * z)), dtype)
        return round_to_dtype(gelu * up, dtype)
    else:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        sig = round_to_dtype(1.0 / (1.0 + tl.exp(-round_to_dtype(gate * ALPHA, dtype))), dtype)
        glu = round_to_dtype(gate * sig, dtype)
        return round_to_dtype(round_to_dtype(up + 1.0, dtype) * glu, dtype)


@triton.jit
def _down_epilogue(
    acc,  # [BLOCK_M, BLOCK_N] float32
    weight,  # [BLOCK_M] float32 routing weights
    b_ptr,  # HAS_BIAS: [E, H] down biases
    expert,
    cols,  # [BLOCK_N] hidden columns of the tile
    col_mask,
    H: tl.constexpr,
    dtype: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] float32 holding dtype values: weight * (the rounded down product + bias)."""
    y = round_to_dtype(acc, dtype)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * H + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = round_to_dtype(y + bias[None, :], dtype)
    return round_to_dtype(y * weight[:, None], dtype)


@triton.jit
def _store_down(
    acc,  # [BLOCK_M, BLOCK_N] float32 down product
    topk_weights_ptr,  # [M * K] routing weight of each row (any float dtype)
    b_ptr,  # HAS_BIAS: [E, H] down biases
    out_ptr,  # [M * K, H] out, contiguous
    rows,  # [BLOCK_M] int64 (0 for padding)
    valid,
    expert,
    cols,  # [BLOCK_N] hidden columns of the tile
    col_mask,
    H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Stores `_down_epilogue` of the tile (times each row's routing weight) in out's dtype."""
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(topk_weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    y = _down_epilogue(acc, weight, b_ptr, expert, cols, col_mask, H, dtype, HAS_BIAS)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], y.to(dtype), mask=valid[:, None] & col_mask[None, :])
