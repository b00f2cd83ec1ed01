"""Gumbel-max sampling with a stateless RNG keyed by (request seed, token position, token id).

The noise of a request depends only on its seed and the position of the token being sampled, never on the
batch, so a seeded request draws the same tokens alone or among others, and after preemption. The hash is
32-bit integer arithmetic (`lowbias32` mixing) that `_gumbel_sample_kernel` reproduces bit for bit with
`tl.uint32` arithmetic; the reference does the same in int64 with explicit masking.

    key(seed, pos)   = mix(mix(seed_lo + mix(seed_hi + 0x632BE5AB)) ^ pos * 0x9E3779B9)
    bits(tok)        = mix(key ^ tok * 0x85EBCA6B)
    u                = ((bits >> 8) + 0.5) / 2**24          in (0, 1), float32
    sample           = argmax(logits - log(-log(u)))        first index on ties; all -inf -> 0
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.counter_hash import MASK32, mix32, mul32, row_keys  # noqa: F401 (re-exported)
from samplers.triton_utils import use_triton, vocab_block


def hash_bits_reference(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[L, V] int64 holding the 32-bit hash of (seed, position, token id) of every logits row and token."""
    token_hash = mul32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64), 0x85EBCA6B)
    return mix32(row_keys(seeds, positions).unsqueeze(1) ^ token_hash.unsqueeze(0))


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) from int64-held 32-bit hashes: the one place the formula is written in
    PyTorch (`_uniform` is the Triton one)."""
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def uniform_noise_reference(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[L, V] float32 uniforms in (0, 1), a pure function of (seed, position, token id)."""
    return uniform_from_bits(hash_bits_reference(seeds, positions, vocab_size))


def gumbel_sample_reference(
    logits: torch.Tensor,  # [L, V] float32, already temperature-scaled and masked (-inf = excluded)
    seeds: torch.Tensor,  # [L] int64: seed of each logits row's request
    positions: torch.Tensor,  # [L] int64: position the sampled token will occupy
) -> torch.Tensor:
    """[L] int64: argmax(logits + Gumbel noise), an exact sample from softmax(logits)."""
    u = uniform_noise_reference(seeds, positions, logits.shape[1])
    gumbel = -torch.log(-torch.log(u))
    # u rounds to 1.0 for about one token in 2**25: its noise is +inf, and -inf + inf = NaN, which argmax would
    # pick. An excluded token never wins, as in the kernels (their comparisons skip NaN).
    return torch.argmax(torch.where(logits == float("-inf"), float("-inf"), logits + gumbel), dim=-1)


# ---- Triton ------------------------------------------------------------------------------------------------


@triton.jit
def _mix32(x):
    """lowbias32 on tl.uint32 (multiplication wraps modulo 2**32, shifts are logical)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D).to(tl.uint32)  # the casts keep the low 32 bits whatever the literal's type
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B).to(tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, position):
    """uint32 key of one logits row from its int64 seed and int64 position (see `row_keys`)."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32((seed_lo + _mix32((seed_hi + 0x632BE5AB).to(tl.uint32))).to(tl.uint32))
    return _mix32(key ^ ((position & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B9).to(tl.uint32))


@triton.jit
def _token_bits(key, token_ids):
    return _mix32(key ^ (token_ids.to(tl.uint32) * 0x85EBCA6B).to(tl.uint32))


@triton.jit
def _uniform(key, token_ids):
    """float32 uniforms in (0, 1) of `token_ids` in the row keyed by `key` (see `uniform_from_bits`)."""
    return ((_token_bits(key, token_ids) >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _gumbel_noise(key, token_ids):
    """The Gumbel noise -log(-log(u)) every sampling kernel adds (u = `_uniform`; +inf when u rounds to 1)."""
    return -tl.log(-tl.log(_uniform(key, token_ids)))


@triton.jit
def _gumbel_sample_kernel(
    logits_ptr,
    logits_stride,
    seeds_ptr,
    positions_ptr,
    out_ptr,
    vocab_size,
    BLOCK: tl.constexpr,
):
    logits_row = tl.program_id(0).to(tl.int64)
    key = _row_key(tl.load(seeds_ptr + logits_row), tl.load(positions_ptr + logits_row))
    best_value = tl.full([], -float("inf"), tl.float32)
    best_token = tl.zeros([], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK):
        token_ids = start + tl.arange(0, BLOCK)
        mask = token_ids < vocab_size
        logits = tl.load(logits_ptr + logits_row * logits_stride + token_ids, mask=mask, other=-float("inf"))
        noisy = tl.where(mask, logits + _gumbel_noise(key, token_ids), -float("inf"))
        block_best = tl.max(noisy, axis=0)
        block_token = tl.argmax(noisy, axis=0, tie_break_left=True)
        # Strictly greater: on a tie across blocks the first (lowest) token id wins, like torch.argmax.
        take = block_best > best_value
        best_token = tl.where(take, start + block_token, best_token)
        best_value = tl.where(take, block_best, best_value)
    tl.store(out_ptr + logits_row, best_token.to(tl.int64))


def gumbel_sample_triton(
    logits: torch.Tensor,  # [L, V] float32, temperature-scaled and masked (-inf = excluded), no NaN
    seeds: torch.Tensor,  # [L] int64: seed of each logits row's request
    positions: torch.Tensor,  # [L] int64: position the sampled token will occupy
) -> torch.Tensor:
    """[L] int64, same result as `gumbel_sample_reference` (one program per logits row)."""
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    _gumbel_sample_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        seeds.long().contiguous(),
        positions.long().contiguous(),
        out,
        vocab_size,
        BLOCK=vocab_block(vocab_size),
    )
    return out


def gumbel_sample(
    logits: torch.Tensor,  # [L, V] float32, temperature-scaled and masked (-inf = excluded), no NaN
    seeds: torch.Tensor,  # [L] int64
    positions: torch.Tensor,  # [L] int64
) -> torch.Tensor:
    """[L] int64 sampled token ids: Triton on CUDA, the reference elsewhere."""
    if use_triton(logits):
        return gumbel_sample_triton(logits, seeds, positions)
    return gumbel_sample_reference(logits, seeds, positions)
