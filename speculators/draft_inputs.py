"""Inputs of a draft model's first pass over one step's tokens (EAGLE, EAGLE-3, MTP).

Row p of the first pass reads the target's hidden state at position p and the token at position p + 1, so
the input ids are this step's tokens shifted left by one within each row. Past the last *accepted* position of
a row (`n - 1 - num_rejected`) the shifted ids are rejected drafts; at that position the next token is the
row's last sampled token, or, for a prefill chunk that samples nothing, the next prompt token from the
history. Later positions of the row are rejected and their draft KV is overwritten by the next step.

Index spaces: `token` (0..T-1, this step's flattened tokens), `batch_row` (0..R-1), `req_slot`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class DraftInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64: token at position p + 1 for each of this step's tokens p
    last_token_index: torch.Tensor  # [R] int64: token index of each row's last accepted position


def prepare_draft_inputs_reference(
    input_ids: torch.Tensor,  # [T] int64: this step's target input ids
    query_start_loc: torch.Tensor,  # [R+1] int32: first token of each batch row
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    seq_lens: torch.Tensor,  # [R] int32: KV length of each row after this step (positions 0..seq_len-1)
    sampled: torch.Tensor,  # [R, K+1] int64: tokens sampled per row (first num_sampled valid)
    num_sampled: torch.Tensor,  # [R] int32
    num_rejected: torch.Tensor,  # [R] int32
    all_token_ids: torch.Tensor,  # [S, max_model_len] int32: history per req_slot (prefill tokens, then sampled)
) -> DraftInputs:
    """Shift each row's ids left by one and put its next token at its last accepted position."""
    num_tokens = input_ids.numel()
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    last = ends - 1 - num_rejected.long()  # [R]
    shifted = torch.zeros_like(input_ids)
    shifted[:-1] = input_ids[1:]
    rows = torch.repeat_interleave(
        torch.arange(starts.numel(), device=input_ids.device), ends - starts, output_size=num_tokens
    )
    shifted = torch.where(torch.arange(num_tokens, device=input_ids.device) < last[rows], shifted, 0)
    last_sampled = sampled.gather(1, (num_sampled.long() - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    max_len = all_token_ids.shape[1]
    from_history = all_token_ids[idx_mapping.long(), seq_lens.long().clamp(max=max_len - 1)].long()
    from_history = torch.where(seq_lens < max_len, from_history, 0)
    nxt = torch.where(num_sampled > 0, last_sampled, from_history)
    shifted[last] = nxt
    return DraftInputs(shifted, last)


@triton.jit
def _prepare_draft_inputs_kernel(
    input_ids_ptr,
    query_start_loc_ptr,
    idx_mapping_ptr,
    seq_lens_ptr,
    sampled_ptr,
    sampled_stride,
    num_sampled_ptr,
    num_rejected_ptr,
    all_token_ids_ptr,
    token_stride,
    max_len,
    out_ids_ptr,
    last_index_ptr,
    BLOCK: tl.constexpr,
):
    # One program per batch row.
    row = tl.program_id(0)
    q_start = tl.load(query_start_loc_ptr + row)
    n = tl.load(query_start_loc_ptr + row + 1) - q_start
    last = n - 1 - tl.load(num_rejected_ptr + row)
    ns = tl.load(num_sampled_ptr + row)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + row)
    last_sampled = tl.load(sampled_ptr + row * sampled_stride + tl.maximum(ns - 1, 0))
    hist = tl.load(
        all_token_ids_ptr + slot * token_stride + tl.minimum(seq_len, max_len - 1),
        mask=(ns == 0) & (seq_len < max_len),
        other=0,
    ).to(tl.int64)
    nxt = tl.where(ns > 0, last_sampled, hist)
    for off in range(0, n, BLOCK):
        j = off + tl.arange(0, BLOCK)
        mask = j < n
        shifted = tl.load(input_ids_ptr + q_start + j + 1, mask=mask & (j < last), other=0)
        tl.store(out_ids_ptr + q_start + j, tl.where(j == last, nxt, shifted), mask=mask)
    tl.store(last_index_ptr + row, (q_start + last).to(tl.int64))


def prepare_draft_inputs_triton(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    idx_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    all_token_ids: torch.Tensor,
) -> DraftInputs:
    """Triton version of `prepare_draft_inputs_reference` (`all_token_ids` may be in pinned host memory)."""
    num_rows = idx_mapping.numel()
    out = torch.empty_like(input_ids)
    last = torch.empty(num_rows, dtype=torch.int64, device=input_ids.device)
    if num_rows:
        _prepare_draft_inputs_kernel[(num_rows,)](
            input_ids,
            query_start_loc,
            idx_mapping,
            seq_lens,
            sampled,
            sampled.stride(0),
            num_sampled,
            num_rejected,
            all_token_ids,
            all_token_ids.stride(0),
            all_token_ids.shape[1],
            out,
            last,
            BLOCK=256,
        )
    return DraftInputs(out, last)


def prepare_draft_inputs(*args: torch.Tensor) -> DraftInputs:
    """Dispatching `prepare_draft_inputs_reference` / `_triton` (same arguments): Triton on CUDA tensors."""
    fn = prepare_draft_inputs_triton if args[0].is_cuda else prepare_draft_inputs_reference
    return fn(*args)
