"""Random weights that are the same on every device: a counter-based normal generator.

`torch.Generator` streams are device-specific: the same seed draws different numbers on the CPU (Mersenne
Twister) and on CUDA (Philox), so a preset's random weights used to depend on the device, and a CPU run and a
GPU run of `random_tiny` compared two different models. Here element `i` of parameter stream `s` is a pure
function of `(seed, s, i)`:

    key      = mix(mix(seed_lo + mix(seed_hi + 0x632BE5AB)) ^ s * 0x9E3779B9)    (`counter_hash.row_keys`)
    bits_j   = mix(mix(key ^ j) ^ i * 0x85EBCA6B)                                j = 1, 2: two 32-bit draws
    u_j      = (bits_j + 0.5) / 2**32                                            in (0, 1), float64
    weight   = std * sqrt(-2 ln u_1) * cos(2 pi u_2)                             (Box-Muller), to float32

`mix` is the lowbias32 hash of `framework/layers/kernels/counter_hash.py`. The hashing is exact uint32 arithmetic:
numpy on the CPU
(native wrapping multiplication), int64 torch ops with explicit masking on other devices (`mix32`). Both give
the same bits; the float64 Box-Muller step may differ by an ulp between libraries, which the rounding to
float32 almost always absorbs (a few elements in a billion may differ in their last bit). Values are drawn
in chunks to bound the scratch memory.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from framework.layers.kernels.counter_hash import mix32, mul32, row_keys

CHUNK = 1 << 24  # elements per pass: at most ~1 GiB of int64 / float64 scratch
MAX_NUMEL = 1 << 32  # the element counter is 32-bit
INDEX_MULTIPLIER = 0x85EBCA6B  # odd: i -> i * c mod 2**32 is a bijection


def stream_keys(seed: int, stream: int) -> tuple[int, int]:
    """The two 32-bit keys (draw 1, draw 2) of parameter `stream` under `seed` (any int64)."""
    key = row_keys(torch.tensor([seed], dtype=torch.int64), torch.tensor([stream], dtype=torch.int64))
    return int(mix32(key ^ 1)[0]), int(mix32(key ^ 2)[0])


def _mix_numpy(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint32 arrays (multiplication wraps modulo 2**32, shifts are logical)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _chunk_numpy(keys: tuple[int, int], start: int, end: int, std: float) -> np.ndarray:
    """[end - start] float32 weights, numpy uint32 hashing (the CPU path)."""
    index = np.arange(start, end, dtype=np.uint64).astype(np.uint32) * np.uint32(INDEX_MULTIPLIER)
    u1 = (_mix_numpy(np.uint32(keys[0]) ^ index).astype(np.float64) + 0.5) * 2.0**-32
    u2 = (_mix_numpy(np.uint32(keys[1]) ^ index).astype(np.float64) + 0.5) * 2.0**-32
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos((2.0 * math.pi) * u2) * std).astype(np.float32)


def _chunk_torch(keys: tuple[int, int], start: int, end: int, std: float, device: torch.device) -> torch.Tensor:
    """[end - start] float32 weights, int64 torch hashing on `device` (the GPU path; any device)."""
    index = mul32(torch.arange(start, end, dtype=torch.int64, device=device), INDEX_MULTIPLIER)
    u1 = (mix32(index ^ keys[0]).double() + 0.5) * 2.0**-32  # never 0: the log is finite
    u2 = (mix32(index ^ keys[1]).double() + 0.5) * 2.0**-32
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2) * std).float()


def normal_weights(
    shape: tuple[int, ...] | torch.Size,
    std: float,
    seed: int,
    stream: int,
    device: torch.device,
) -> torch.Tensor:
    """[shape] float32 draws of N(0, std**2) on `device`: a pure function of (seed, stream, element index)."""
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise ValueError(f"random weights of {numel} elements exceed the generator's 2**32-element stream")
    keys = stream_keys(seed, stream)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for start in range(0, numel, CHUNK):
        end = min(start + CHUNK, numel)
        if device.type == "cpu":
            out[start:end] = torch.from_numpy(_chunk_numpy(keys, start, end, std))
        else:
            out[start:end] = _chunk_torch(keys, start, end, std, device)
    return out.view(tuple(shape))
