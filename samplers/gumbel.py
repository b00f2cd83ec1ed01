"""Gumbel-max sampling with a stateless RNG keyed by (request seed, token position, token id).

The noise of a request depends only on its seed and the position of the token being sampled, never on the
batch, so a seeded request draws the same tokens alone or among others, and after preemption. The hash is
32-bit integer arithmetic that a Triton kernel reproduces bit for bit (`lowbias32` mixing).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow (split c in 16-bit halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash: a bijection on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[L] int64 32-bit key per logits row from its request seed (any int64) and sampled-token position."""
    seeds = seeds.long()
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    key = mix32((seed_lo + mix32((seed_hi + 0x632BE5AB) & _MASK32)) & _MASK32)
    return mix32(key ^ _mul32(positions.long() & _MASK32, 0x9E3779B9))


def uniform_noise_reference(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[L, V] float32 uniforms in (0, 1), a pure function of (seed, position, token id)."""
    token_hash = _mul32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64), 0x85EBCA6B)
    bits = mix32(row_keys(seeds, positions).unsqueeze(1) ^ token_hash.unsqueeze(0))
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def gumbel_sample_reference(
    logits: torch.Tensor,  # [L, V] float32, already temperature-scaled and masked (-inf = excluded)
    seeds: torch.Tensor,  # [L] int64: seed of each logits row's request
    positions: torch.Tensor,  # [L] int64: position the sampled token will occupy
) -> torch.Tensor:
    """[L] int64: argmax(logits + Gumbel noise), an exact sample from softmax(logits)."""
    u = uniform_noise_reference(seeds, positions, logits.shape[1])
    gumbel = -torch.log(-torch.log(u))
    return torch.argmax(logits + gumbel, dim=-1)
