"""Grammar bitmask: -inf for every token a request's grammar forbids, on the logits rows it constrains.

The mask is compact: one row of 32-bit words per constrained logits row (bit t % 32 of word t // 32 set =
token t allowed) and the logits row it applies to; rows that are not listed are left as they are, so an
unconstrained row costs nothing and a batch with no constrained row launches nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv
from samplers.triton_utils import use_triton

WORDS_PER_PROGRAM = 32  # 1024 tokens per program: one 4 KB logits strip


def bitmask_words(vocab_size: int) -> int:
    """32-bit words per mask row."""
    return -(-vocab_size // 32)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, logits_rows: torch.Tensor) -> None:
    num_words = bitmask_words(logits.shape[1])
    if bitmask.dim() != 2 or bitmask.shape[1] != num_words or bitmask.dtype != torch.int32:
        raise ValueError(
            f"grammar bitmask must be int32 [N, {num_words}] for vocabulary {logits.shape[1]}, got "
            f"{bitmask.dtype} {list(bitmask.shape)}"
        )
    if logits_rows.shape != (bitmask.shape[0],):
        raise ValueError(f"logits_rows must be [{bitmask.shape[0]}] (one per mask row), got {list(logits_rows.shape)}")


def apply_token_bitmask_reference(
    logits: torch.Tensor,  # [L, V] float32, written in place
    bitmask: torch.Tensor,  # [N, ceil(V / 32)] int32: mask row i, bit t set = token t allowed
    logits_rows: torch.Tensor,  # [N] int32/int64: the logits_row mask row i applies to (distinct)
) -> torch.Tensor:
    """[L, V]: -inf where a listed row's bit is clear; unlisted rows unchanged."""
    _check(logits, bitmask, logits_rows)
    if bitmask.shape[0] == 0:
        return logits
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[1]]  # [N, V]
    rows = logits_rows.long()
    logits[rows] = logits[rows].masked_fill(bits == 0, float("-inf"))
    return logits


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr, logits_stride, mask_ptr, mask_stride, rows_ptr, vocab_size, num_words, WORDS: tl.constexpr
):
    mask_row = tl.program_id(0).to(tl.int64)
    logits_row = tl.load(rows_ptr + mask_row).to(tl.int64)
    word = tl.program_id(1) * WORDS + tl.arange(0, WORDS)  # [WORDS]
    words = tl.load(mask_ptr + mask_row * mask_stride + word, mask=word < num_words, other=-1)
    bit = tl.arange(0, 32)
    forbidden = ((words[:, None] >> bit[None, :]) & 1) == 0  # [WORDS, 32]
    token = word[:, None] * 32 + bit[None, :]
    # Only forbidden entries are written: allowed logits are never read or rewritten.
    tl.store(logits_ptr + logits_row * logits_stride + token, float("-inf"), mask=forbidden & (token < vocab_size))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, logits_rows: torch.Tensor) -> torch.Tensor:
    """In place, same result as `apply_token_bitmask_reference` (grid: mask rows x 1024-token strips)."""
    _check(logits, bitmask, logits_rows)
    num_rows, num_words = bitmask.shape
    if num_rows:
        grid = (num_rows, cdiv(num_words, WORDS_PER_PROGRAM))
        _apply_token_bitmask_kernel[grid](
            logits,
            logits.stride(0),
            bitmask,
            bitmask.stride(0),
            logits_rows,
            logits.shape[1],
            num_words,
            WORDS=WORDS_PER_PROGRAM,
        )
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, logits_rows: torch.Tensor) -> torch.Tensor:
    """[L, V] masked logits (Triton on CUDA, in place; the reference elsewhere)."""
    fn = apply_token_bitmask_triton if use_triton(logits) else apply_token_bitmask_reference
    return fn(logits, bitmask, logits_rows)
