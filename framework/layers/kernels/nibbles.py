"""Triton helpers that spread packed 4-bit values into registers, in the order their packing defines.

Each builds the wider tile from `tl.join`s: a join's new axis lives inside one thread, so a word's (or byte's)
values stay in the thread that loaded it and the row-major reshape yields runs of consecutive inputs per thread
(vector stores to shared memory for the tensor-core product), where broadcasting shifts over a new axis let the
compiler spread one word's nibbles over eight threads. References: `unpack_rows` (`triton_w4a16.py`) and
`dequantize_mxfp4` (`moe_epilogue.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def spread_int4_words(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 words [ROWS, COLS / 8] -> [ROWS, COLS] values 0..15: input 8c + j is bits 4j..4j+3 of word c."""
    n0 = packed & 0xF
    n1 = (packed >> 4) & 0xF
    n2 = (packed >> 8) & 0xF
    n3 = (packed >> 12) & 0xF
    n4 = (packed >> 16) & 0xF
    n5 = (packed >> 20) & 0xF
    n6 = (packed >> 24) & 0xF
    n7 = (packed >> 28) & 0xF
    # join(x, y)[..., 0] = x, [..., 1] = y: t_a[r, c, h, b] = nibble 4h + 2b + a, and the row-major reshape of
    # [r, c, h, b, a] puts it at input 8c + 4h + 2b + a
    t0 = tl.join(tl.join(n0, n4), tl.join(n2, n6))
    t1 = tl.join(tl.join(n1, n5), tl.join(n3, n7))
    return tl.reshape(tl.join(t0, t1), (ROWS, COLS))


@triton.jit
def spread_fp4_bytes(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 bytes [ROWS, COLS / 2] -> [ROWS, COLS] 4-bit codes: input 2c in the low nibble of byte c, 2c + 1 in
    the high one."""
    return tl.reshape(tl.join(packed & 0xF, (packed >> 4) & 0xF), (ROWS, COLS))
