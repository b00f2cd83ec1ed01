"""thinking_token_budget: a reasoning model's thinking section ends after `budget` output tokens. At output
index `budget + j` (j < len(end)) the row may only sample `end[j]`, the j-th token of the end-of-thinking
sequence (`</think>`), unless the output before that index already holds the whole sequence (the model ended
its thinking itself). The output count of a logits row is `sample_position - prompt_len`, as for min_tokens, and
the check reads the token history on the device: no host sync, the same work in a captured graph."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from framework.batch.staged_writes import StagedWrites
from framework.params.sampling_params import SamplingParams
from samplers.history import SlotLists, TokenHistory, context_tokens_reference
from samplers.triton_utils import small_block, use_triton, vocab_block

SCAN_BLOCK = 64  # candidate start positions compared at once by the kernel


class ThinkingBudgetState:
    """budget [S+1] int32 (-1: off) and each slot's end-of-thinking ids (padded [S+1, W] int32). Row
    `max_num_reqs` (budget -1) serves the padding rows of full-step graphs."""

    def __init__(self, max_num_reqs: int, device: torch.device, history: TokenHistory) -> None:
        self.history = history
        rows = max_num_reqs + 1
        self.budget = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self.end_ids = SlotLists(rows, torch.int32, device)
        self.host_budget = np.full(rows, -1, dtype=np.int64)
        self._staged = StagedWrites(self.budget)

    def add_request(self, req_slot: int, params: SamplingParams) -> None:
        end = list(params.thinking_end_token_ids or [])
        budget = params.thinking_token_budget if params.thinking_token_budget is not None and end else -1
        self.host_budget[req_slot] = budget
        self._staged.stage(req_slot, budget)
        self.end_ids.set(req_slot, end if budget >= 0 else [])

    def remove_request(self, req_slot: int) -> None:
        self.host_budget[req_slot] = -1

    def reserve(self, width: int) -> None:
        """Room for `width` end ids per slot now (full-step graphs read the table at a fixed address)."""
        self.end_ids.reserve(width)

    def apply_staged_writes(self) -> None:
        self._staged.apply()
        self.end_ids.apply_staged_writes()

    def any_in(self, req_slots: np.ndarray) -> bool:
        return bool((self.host_budget[req_slots] >= 0).any())

    def apply(
        self, logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, sample_positions: torch.Tensor
    ) -> torch.Tensor:
        return apply_thinking_budget(
            logits,
            expanded_idx_mapping,
            sample_positions,
            self.history,
            self.budget,
            self.end_ids.values,
            self.end_ids.lens,
            int(self.host_budget.max()),
        )


def apply_thinking_budget_reference(
    logits: torch.Tensor,  # [L, V] float32
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    sample_positions: torch.Tensor,  # [L] int64: position of the token each row samples
    history: TokenHistory,
    budget: torch.Tensor,  # [S] int32: -1 = off
    end_ids: torch.Tensor,  # [S, W] int32
    end_lens: torch.Tensor,  # [S] int32
    max_budget: int,  # largest budget of any slot (host): bounds the scan
) -> torch.Tensor:
    """[L, V]: rows whose thinking reached its budget (and did not end by itself) keep only the next end token
    (logit 0, every other -inf)."""
    device = logits.device
    slots = expanded_idx_mapping.long()
    prompt_len = history.prompt_len.long()[slots]
    num_output = sample_positions.long() - prompt_len  # [L]
    b, m = budget.long()[slots], end_lens.long()[slots]
    j = num_output - b
    in_window = (b >= 0) & (j >= 0) & (j < m)  # [L]
    if max_budget < 0 or not bool(in_window.any()):
        return logits
    width = end_ids.shape[1]
    i = torch.arange(width, device=device).view(1, 1, -1)  # [1, 1, W]
    start = torch.arange(max_budget + 1, device=device).view(1, -1, 1)  # [1, B+1, 1]: start of a candidate
    ctx_pos = prompt_len.view(-1, 1, 1) + start + i  # [L, B+1, W]
    ctx = context_tokens_reference(history, slots.view(-1, 1, 1).expand_as(ctx_pos), ctx_pos)
    same = (ctx == end_ids.long()[slots].unsqueeze(1)) | (i >= m.view(-1, 1, 1))
    fits = start.squeeze(2) <= (num_output - m).unsqueeze(1)  # [L, B+1]: the candidate lies in the output so far
    ended = (same.all(dim=2) & fits).any(dim=1)  # [L]
    force = in_window & ~ended
    forced = end_ids.long()[slots, j.clamp(0, width - 1)]  # [L]
    only = torch.where(torch.arange(logits.shape[1], device=device) == forced.unsqueeze(1), 0.0, float("-inf"))
    return torch.where(force.unsqueeze(1), only, logits)


@triton.jit
def _apply_thinking_budget_kernel(
    logits_ptr,
    logits_stride,
    vocab_size,
    idx_ptr,
    positions_ptr,
    all_tokens_ptr,
    all_tokens_stride,
    total_len_ptr,
    prompt_len_ptr,
    drafts_ptr,
    drafts_stride,
    num_drafts,
    budget_ptr,
    end_ptr,
    end_stride,
    end_lens_ptr,
    SCAN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    logits_row = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(idx_ptr + logits_row).to(tl.int64)
    budget = tl.load(budget_ptr + req_slot)
    prompt_len = tl.load(prompt_len_ptr + req_slot)
    num_output = tl.load(positions_ptr + logits_row) - prompt_len
    m = tl.load(end_lens_ptr + req_slot)
    j = num_output - budget
    if (budget >= 0) & (j >= 0) & (j < m):
        total_len = tl.load(total_len_ptr + req_slot)
        ended = tl.zeros([], dtype=tl.int32)
        for first in range(0, num_output - m + 1, SCAN):  # every start of a whole end sequence in the output
            s = first + tl.arange(0, SCAN)
            match = s <= num_output - m
            for i in range(0, m):
                pos = prompt_len + s + i
                from_history = match & (pos < total_len)
                from_drafts = match & (pos >= total_len) & (pos - total_len < num_drafts)
                tok = tl.load(all_tokens_ptr + req_slot * all_tokens_stride + pos, mask=from_history, other=-1)
                tok = tl.where(
                    from_drafts,
                    tl.load(drafts_ptr + req_slot * drafts_stride + (pos - total_len), mask=from_drafts, other=-1),
                    tok,
                )
                match = match & (tok == tl.load(end_ptr + req_slot * end_stride + i))
            ended = tl.maximum(ended, tl.max(match.to(tl.int32), axis=0))
        if ended == 0:
            forced = tl.load(end_ptr + req_slot * end_stride + j)
            row = logits_ptr + logits_row * logits_stride
            for v in range(0, vocab_size, BLOCK_V):
                offs = v + tl.arange(0, BLOCK_V)
                keep = offs == forced
                tl.store(row + offs, tl.where(keep, 0.0, -float("inf")), mask=offs < vocab_size)


def apply_thinking_budget_triton(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    sample_positions: torch.Tensor,
    history: TokenHistory,
    budget: torch.Tensor,
    end_ids: torch.Tensor,
    end_lens: torch.Tensor,
    max_budget: int,
) -> torch.Tensor:
    """In place, same result as `apply_thinking_budget_reference` (one program per logits row; `max_budget` is
    not read: the kernel's loops are bounded by each row's own count)."""
    if logits.shape[0]:
        drafts = history.draft_tokens
        num_drafts = drafts.shape[1] if drafts.dim() == 2 else 0
        if num_drafts == 0:
            drafts = history.total_len  # never read (num_drafts = 0), but a real pointer
        _apply_thinking_budget_kernel[(logits.shape[0],)](
            logits,
            logits.stride(0),
            logits.shape[1],
            expanded_idx_mapping,
            sample_positions,
            history.all_token_ids,
            history.all_token_ids.stride(0),
            history.total_len,
            history.prompt_len,
            drafts,
            drafts.stride(0) if num_drafts else 0,
            num_drafts,
            budget,
            end_ids,
            end_ids.stride(0),
            end_lens,
            SCAN=small_block(SCAN_BLOCK),
            BLOCK_V=vocab_block(logits.shape[1]),
        )
    return logits


def apply_thinking_budget(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    sample_positions: torch.Tensor,
    history: TokenHistory,
    budget: torch.Tensor,
    end_ids: torch.Tensor,
    end_lens: torch.Tensor,
    max_budget: int,
) -> torch.Tensor:
    """[L, V] logits with the end of thinking forced where the budget is spent (Triton on CUDA, in place; the
    reference elsewhere)."""
    fn = apply_thinking_budget_triton if use_triton(logits) else apply_thinking_budget_reference
    return fn(logits, expanded_idx_mapping, sample_positions, history, budget, end_ids, end_lens, max_budget)
