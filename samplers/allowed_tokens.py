"""allowed_token_ids: a request may sample only from its list; every other token gets -inf."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from framework.batch.staged_writes import StagedWrites
from framework.layers.kernels.launch_math import cdiv
from framework.params.sampling_params import SamplingParams
from samplers.triton_utils import use_triton, vocab_block


class AllowedTokensState:
    """A [S+1, V] bool mask (allocated when the first request with a list arrives, or before full-step graphs
    are captured: `allocate_mask`) and a per-slot on/off flag. Row `max_num_reqs` (off) serves the padding rows
    of full-step graphs (`framework.runner.graphs.step_graphs`)."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        rows = max_num_reqs + 1  # + the dummy slot of full-step graphs
        self.enabled = torch.zeros(rows, dtype=torch.bool, device=device)  # [S+1]
        self.mask: Optional[torch.Tensor] = None  # [S+1, V] bool: True = allowed
        self.host_enabled = np.zeros(rows, dtype=bool)
        self._staged_enabled = StagedWrites(self.enabled)
        self._staged_rows: dict[int, list[int]] = {}

    def add_request(self, req_slot: int, params: SamplingParams) -> None:
        ids = params.allowed_token_ids
        self.host_enabled[req_slot] = ids is not None
        self._staged_enabled.stage(req_slot, ids is not None)
        if ids is not None:
            self.allocate_mask()
            self._staged_rows[req_slot] = list(ids)

    def allocate_mask(self) -> None:
        """The [S+1, V] mask, once (full-step graphs allocate it before capture: they read it at a fixed address)."""
        if self.mask is None:
            self.mask = torch.zeros(self.max_num_reqs + 1, self.vocab_size, dtype=torch.bool, device=self.device)

    def remove_request(self, req_slot: int) -> None:
        self.host_enabled[req_slot] = False

    def apply_staged_writes(self) -> None:
        self._staged_enabled.apply()
        if self._staged_rows and self.mask is not None:
            slots = list(self._staged_rows)
            rows = torch.tensor([s for s in slots for _ in self._staged_rows[s]], dtype=torch.int64)
            cols = torch.tensor([t for s in slots for t in self._staged_rows[s]], dtype=torch.int64)
            self.mask[torch.tensor(slots, dtype=torch.int64).to(self.device)] = False
            self.mask[rows.to(self.device), cols.to(self.device)] = True
        self._staged_rows.clear()

    def any_in(self, req_slots: np.ndarray) -> bool:
        return bool(self.host_enabled[req_slots].any())

    def apply(self, logits: torch.Tensor, expanded_idx_mapping: torch.Tensor) -> torch.Tensor:
        assert self.mask is not None
        return apply_allowed_tokens(logits, expanded_idx_mapping, self.enabled, self.mask)


def apply_allowed_tokens_reference(
    logits: torch.Tensor,  # [L, V] float32
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    enabled: torch.Tensor,  # [S] bool: the slot has an allowed list
    mask: torch.Tensor,  # [S, V] bool: True = allowed
) -> torch.Tensor:
    """[L, V]: -inf for every token outside the allowed list of rows whose slot has one."""
    slots = expanded_idx_mapping.long()
    drop = enabled[slots].unsqueeze(1) & ~mask[slots]
    return logits.masked_fill(drop, float("-inf"))


@triton.jit
def _apply_allowed_tokens_kernel(
    logits_ptr, logits_stride, idx_ptr, enabled_ptr, mask_ptr, vocab_size, BLOCK: tl.constexpr
):
    logits_row = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(idx_ptr + logits_row).to(tl.int64)
    if tl.load(enabled_ptr + req_slot) != 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offs < vocab_size
        allowed = tl.load(mask_ptr + req_slot * vocab_size + offs, mask=in_vocab, other=0) != 0
        ptrs = logits_ptr + logits_row * logits_stride + offs
        tl.store(ptrs, tl.where(allowed, tl.load(ptrs, mask=in_vocab), -float("inf")), mask=in_vocab)


def apply_allowed_tokens_triton(
    logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, enabled: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """In place, same result as `apply_allowed_tokens_reference` (grid: logits rows x vocab blocks)."""
    num_rows, vocab_size = logits.shape
    if num_rows:
        block = vocab_block(vocab_size)
        _apply_allowed_tokens_kernel[(num_rows, cdiv(vocab_size, block))](
            logits,
            logits.stride(0),
            expanded_idx_mapping,
            enabled,
            mask,
            vocab_size,
            BLOCK=block,
        )
    return logits


def apply_allowed_tokens(
    logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, enabled: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """[L, V] masked logits (Triton on CUDA, writing in place; the reference elsewhere)."""
    fn = apply_allowed_tokens_triton if use_triton(logits) else apply_allowed_tokens_reference
    return fn(logits, expanded_idx_mapping, enabled, mask)
