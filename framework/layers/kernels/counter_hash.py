"""The 32-bit counter hash behind mrv2's stateless randomness (sampling noise, random test weights).

`lowbias32` mixing in exact uint32 arithmetic, held in int64 with explicit masking so that every device gives
the same bits; the Triton kernels (`samplers/gumbel.py`) reproduce it with `tl.uint32`.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow (split c in 16-bit halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash: a bijection on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[L] int64 32-bit key per logits row from its request seed (any int64) and sampled-token position."""
    seeds = seeds.long()
    seed_lo = seeds & MASK32
    seed_hi = (seeds >> 32) & MASK32
    key = mix32((seed_lo + mix32((seed_hi + 0x632BE5AB) & MASK32)) & MASK32)
    return mix32(key ^ mul32(positions.long() & MASK32, 0x9E3779B9))
