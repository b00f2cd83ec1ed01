"""min_tokens: the request's stop tokens (eos unless ignore_eos, and stop_token_ids) get -inf until it has
produced `min_tokens` tokens. The output count of a logits row is `sample_position - prompt_len`, so it
stays right after a preemption (whose resumed prefill holds earlier output)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from framework.batch.staged_writes import StagedWrites
from framework.params.sampling_params import SamplingParams
from samplers.history import SlotLists, TokenHistory
from samplers.triton_utils import small_block, use_triton


class MinTokensState:
    """min_tokens [S+1] int32 and each slot's stop-token list (padded [S+1, W] int32). Row `max_num_reqs`
    (min_tokens 0: a no-op) serves the padding rows of full-step graphs (`framework.runner.graphs.step_graphs`)."""

    def __init__(
        self, max_num_reqs: int, device: torch.device, history: TokenHistory, eos_token_id: Optional[int]
    ) -> None:
        self.history = history
        self.eos_token_id = eos_token_id
        rows = max_num_reqs + 1  # + the dummy slot of full-step graphs
        self.min_tokens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.stop_ids = SlotLists(rows, torch.int32, device)
        self.host_active = np.zeros(rows, dtype=bool)
        self._staged = StagedWrites(self.min_tokens)

    def add_request(self, req_slot: int, params: SamplingParams) -> None:
        stop_ids = list(dict.fromkeys(params.stop_token_ids))
        if not params.ignore_eos and self.eos_token_id is not None and self.eos_token_id not in stop_ids:
            stop_ids.append(self.eos_token_id)
        active = params.min_tokens > 0 and bool(stop_ids)
        self.host_active[req_slot] = active
        self._staged.stage(req_slot, params.min_tokens if active else 0)
        self.stop_ids.set(req_slot, stop_ids if active else [])

    def remove_request(self, req_slot: int) -> None:
        self.host_active[req_slot] = False

    def reserve(self, width: int) -> None:
        """Room for `width` stop ids per slot now (full-step graphs read the table at a fixed address)."""
        self.stop_ids.reserve(width)

    def apply_staged_writes(self) -> None:
        self._staged.apply()
        self.stop_ids.apply_staged_writes()

    def any_in(self, req_slots: np.ndarray) -> bool:
        return bool(self.host_active[req_slots].any())

    def apply(
        self, logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, sample_positions: torch.Tensor
    ) -> torch.Tensor:
        return apply_min_tokens(
            logits,
            expanded_idx_mapping,
            sample_positions,
            self.history.prompt_len,
            self.min_tokens,
            self.stop_ids.values,
            self.stop_ids.lens,
        )


def apply_min_tokens_reference(
    logits: torch.Tensor,  # [L, V] float32
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    sample_positions: torch.Tensor,  # [L] int64: position of the token each row samples
    prompt_len: torch.Tensor,  # [S] int32
    min_tokens: torch.Tensor,  # [S] int32
    stop_ids: torch.Tensor,  # [S, W] int32
    stop_lens: torch.Tensor,  # [S] int32
) -> torch.Tensor:
    """[L, V]: -inf at the stop ids of rows whose request has produced fewer than min_tokens tokens."""
    slots = expanded_idx_mapping.long()
    too_early = (sample_positions - prompt_len.long()[slots]) < min_tokens.long()[slots]  # [L]
    valid = torch.arange(stop_ids.shape[1], device=logits.device) < stop_lens.long()[slots].unsqueeze(1)
    valid &= too_early.unsqueeze(1)
    inf = torch.full((), float("inf"), device=logits.device)
    # amin keeps the logit where the entry is padding (+inf), so repeated padding ids are harmless.
    return logits.scatter_reduce(1, stop_ids[slots].long(), torch.where(valid, -inf, inf), "amin")


@triton.jit
def _apply_min_tokens_kernel(
    logits_ptr,
    logits_stride,
    idx_ptr,
    positions_ptr,
    prompt_len_ptr,
    min_tokens_ptr,
    stop_ptr,
    stop_lens_ptr,
    stop_stride,
    BLOCK: tl.constexpr,
):
    logits_row = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(idx_ptr + logits_row).to(tl.int64)
    num_output = tl.load(positions_ptr + logits_row) - tl.load(prompt_len_ptr + req_slot)
    if num_output < tl.load(min_tokens_ptr + req_slot):
        n = tl.load(stop_lens_ptr + req_slot)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tokens = tl.load(stop_ptr + req_slot * stop_stride + offs, mask=mask, other=0)
            tl.store(
                logits_ptr + logits_row * logits_stride + tokens, tl.full([BLOCK], -float("inf"), tl.float32), mask=mask
            )


def apply_min_tokens_triton(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    sample_positions: torch.Tensor,
    prompt_len: torch.Tensor,
    min_tokens: torch.Tensor,
    stop_ids: torch.Tensor,
    stop_lens: torch.Tensor,
) -> torch.Tensor:
    """In place, same result as `apply_min_tokens_reference` (one program per logits row)."""
    if logits.shape[0]:
        _apply_min_tokens_kernel[(logits.shape[0],)](
            logits,
            logits.stride(0),
            expanded_idx_mapping,
            sample_positions,
            prompt_len,
            min_tokens,
            stop_ids,
            stop_lens,
            stop_ids.stride(0),
            BLOCK=small_block(min(stop_ids.shape[1], 128)),
        )
    return logits


def apply_min_tokens(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    sample_positions: torch.Tensor,
    prompt_len: torch.Tensor,
    min_tokens: torch.Tensor,
    stop_ids: torch.Tensor,
    stop_lens: torch.Tensor,
) -> torch.Tensor:
    """[L, V] masked logits (Triton on CUDA, writing in place; the reference elsewhere)."""
    fn = apply_min_tokens_triton if use_triton(logits) else apply_min_tokens_reference
    return fn(logits, expanded_idx_mapping, sample_positions, prompt_len, min_tokens, stop_ids, stop_lens)
