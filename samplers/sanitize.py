"""Non-finite logits: NaN and +inf become -inf, and the row is flagged so its request can end with an error
instead of sampling garbage. Other rows are untouched."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv
from samplers.triton_utils import use_triton, vocab_block


def sanitize_logits_reference(
    logits: torch.Tensor,  # [L, V] float32, written in place
) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, V] logits with NaN/+inf replaced by -inf, [L] bool: the row had such a value)."""
    bad = ~(logits < float("inf"))  # one comparison finds both: NaN compares false
    return logits.masked_fill_(bad, float("-inf")), bad.any(dim=-1)


@triton.jit
def _sanitize_logits_kernel(logits_ptr, logits_stride, flags_ptr, vocab_size, BLOCK: tl.constexpr):
    logits_row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    ptrs = logits_ptr + logits_row * logits_stride + offs
    x = tl.load(ptrs, mask=mask, other=0.0)
    bad = mask & ((x != x) | (x == float("inf")))
    num_bad = tl.sum(bad.to(tl.int32), axis=0)
    if num_bad > 0:
        tl.store(ptrs, tl.where(bad, -float("inf"), x), mask=mask)
        tl.atomic_max(flags_ptr + logits_row, tl.full([], 1, tl.int32))


def sanitize_logits_triton(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, same result as `sanitize_logits_reference` (grid: logits rows x vocab blocks)."""
    num_rows, vocab_size = logits.shape
    flags = torch.zeros(num_rows, dtype=torch.int32, device=logits.device)
    if num_rows:
        block = vocab_block(vocab_size)
        _sanitize_logits_kernel[(num_rows, cdiv(vocab_size, block))](
            logits,
            logits.stride(0),
            flags,
            vocab_size,
            BLOCK=block,
        )
    return logits, flags.bool()


def sanitize_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, V] sanitized logits, written in place; [L] bool flags): Triton on CUDA, the reference elsewhere."""
    if use_triton(logits):
        return sanitize_logits_triton(logits)
    return sanitize_logits_reference(logits)
