"""Logprobs of chosen tokens and the top-k, without materialising a [rows, vocab] log-softmax.

For each row: the ids come first (the chosen token, and `torch.topk` of the logits, which is the top-k of
the log-softmax since it only shifts a row), then one pass finds the row max and log-sum-exp and counts the
tokens strictly above the chosen one. logprob = logit - logsumexp; rank = 1 + number of tokens with a
strictly larger logprob (ties share a rank). A row whose logits are all -inf gets -inf logprobs, never NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from samplers.triton_utils import use_triton, vocab_block


class LogprobsTensors(NamedTuple):
    """Per logits row (or prompt position): column 0 is the chosen token, columns 1.. the top-k."""

    token_ids: torch.Tensor  # [N, 1+k] int64
    logprobs: torch.Tensor  # [N, 1+k] float32
    ranks: torch.Tensor  # [N] int64: rank of the chosen token (1 = most likely)


def logprobs_stats_reference(
    logits: torch.Tensor,  # [N, V] float32
    token_ids: torch.Tensor,  # [N] int64: the chosen token of each row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([N] logsumexp, [N] chosen logit, [N] int64 rank of the chosen token)."""
    chosen = logits.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    lse = torch.logsumexp(logits, dim=-1)
    rank = (logits > chosen.unsqueeze(1)).sum(dim=-1) + 1
    return lse, chosen, rank


@triton.jit
def _logprobs_stats_kernel(
    logits_ptr, logits_stride, token_ptr, lse_ptr, chosen_ptr, rank_ptr, vocab_size, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    chosen = tl.load(row_ptr + tl.load(token_ptr + row))
    running_max = tl.full([], -float("inf"), tl.float32)
    running_sum = tl.zeros([], dtype=tl.float32)
    count = tl.zeros([], dtype=tl.int64)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=-float("inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        safe = tl.where(new_max == -float("inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe) + tl.sum(tl.exp(x - safe), axis=0)
        running_max = new_max
        count += tl.sum((x > chosen).to(tl.int64), axis=0)
    empty = running_max == -float("inf")
    lse = tl.where(empty, -float("inf"), running_max + tl.log(tl.where(empty, 1.0, running_sum)))
    tl.store(lse_ptr + row, lse)
    tl.store(chosen_ptr + row, chosen)
    tl.store(rank_ptr + row, count + 1)


def logprobs_stats_triton(
    logits: torch.Tensor, token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same as `logprobs_stats_reference`, one online pass per row (one program per row)."""
    num_rows, vocab_size = logits.shape
    lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    chosen = torch.empty_like(lse)
    rank = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        _logprobs_stats_kernel[(num_rows,)](
            logits,
            logits.stride(0),
            token_ids.long().contiguous(),
            lse,
            chosen,
            rank,
            vocab_size,
            BLOCK=vocab_block(vocab_size),
        )
    return lse, chosen, rank


def logprobs_stats(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([N] logsumexp, [N] chosen logit, [N] rank): Triton on CUDA, the reference elsewhere."""
    if use_triton(logits):
        return logprobs_stats_triton(logits, token_ids)
    return logprobs_stats_reference(logits, token_ids)


def compute_logprobs(
    logits: torch.Tensor,  # [N, V] float32 (raw or processed, by the caller's choice)
    token_ids: torch.Tensor,  # [N] int64: chosen token per row
    num_top: int,  # k >= 0, known on the host
) -> LogprobsTensors:
    """The chosen token's logprob and rank plus the k most likely tokens of each row."""
    lse, chosen, rank = logprobs_stats(logits, token_ids)
    ids = token_ids.long().unsqueeze(1)
    values = chosen.unsqueeze(1)
    if num_top > 0:
        top_values, top_ids = torch.topk(logits, min(num_top, logits.shape[1]), dim=-1)
        ids = torch.cat([ids, top_ids], dim=1)
        values = torch.cat([values, top_values], dim=1)
    finite = torch.isfinite(lse).unsqueeze(1)
    logprobs = torch.where(finite, values - torch.where(finite, lse.unsqueeze(1), 0.0), float("-inf"))
    return LogprobsTensors(ids, logprobs, rank)
