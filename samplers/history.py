"""What the sampler reads of a request's token history, and the per-slot table it keeps its lists in."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from framework.params.request_errors import SlotWriteError


class TokenHistory(Protocol):
    """The per-slot token history the sampler reads (`framework.batch.request_state.RequestState` provides it).

    All tensors are indexed by req_slot and live on the device; `total_len` counts the valid entries of
    `all_token_ids` before this step's tokens are appended, so the context of a logits row sampling
    position p is `all_token_ids[slot, :min(p, total_len)]` followed by the drafts being verified.
    """

    all_token_ids: torch.Tensor  # [S, max_model_len] int32: prefill tokens, then sampled tokens
    prompt_len: torch.Tensor  # [S] int32: the original prompt (not the resumed prefill)
    prefill_len: torch.Tensor  # [S] int32: prompt + output before a preemption
    total_len: torch.Tensor  # [S] int32: valid entries of all_token_ids
    draft_tokens: torch.Tensor  # [S, K] int32: drafts verified this step


def context_tokens_reference(
    history: TokenHistory,
    req_slots: torch.Tensor,  # [...] int64
    positions: torch.Tensor,  # [...] int64, same shape; may be negative or past the history (then 0)
) -> torch.Tensor:
    """[...] int64: the token at `positions` of each request's context (history, then drafts)."""
    total = history.total_len.long()[req_slots]
    max_len = history.all_token_ids.shape[1]
    from_history = history.all_token_ids[req_slots, positions.clamp(0, max_len - 1)].long()
    num_draft = history.draft_tokens.shape[1]
    if num_draft:
        draft_col = (positions - total).clamp(0, num_draft - 1)
        from_drafts = history.draft_tokens[req_slots, draft_col].long()
    else:
        from_drafts = torch.zeros_like(from_history)
    return torch.where(positions < total, from_history, from_drafts)


class SlotLists:
    """A variable-length list of numbers per req_slot, kept in a padded `[S, W]` device tensor.

    `set` stages a slot's whole list (so a reused slot keeps nothing of its previous owner);
    `apply_staged_writes` widens the table when a list does not fit (W doubles) and writes every staged row
    with one copy. `host_lens` mirrors the lengths so that "does any row use this" needs no device sync.
    """

    def __init__(self, max_num_reqs: int, dtype: torch.dtype, device: torch.device, width: int = 8) -> None:
        self.dtype = dtype
        self.device = device
        self.values = torch.zeros(max_num_reqs, width, dtype=dtype, device=device)  # [S, W]
        self.lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # [S]
        self.host_lens = np.zeros(max_num_reqs, dtype=np.int64)
        self._staged: dict[int, list] = {}

    @property
    def width(self) -> int:
        return self.values.shape[1]

    def set(self, req_slot: int, values: Sequence) -> None:
        self._staged[req_slot] = list(values)
        self.host_lens[req_slot] = len(values)

    def apply_staged_writes(self) -> None:
        if not self._staged:
            return
        longest = max(len(v) for v in self._staged.values())
        if longest > self.width:
            width = self.width
            while width < longest:
                width *= 2
            wider = torch.zeros(self.values.shape[0], width, dtype=self.dtype, device=self.device)
            wider[:, : self.width] = self.values
            self.values = wider
        slots = list(self._staged)
        rows = torch.zeros(len(slots), self.width, dtype=self.dtype)
        for i, (slot, values) in enumerate(self._staged.items()):
            if values:
                try:
                    rows[i, : len(values)] = torch.tensor(values, dtype=self.dtype)
                except (OverflowError, RuntimeError, TypeError, ValueError) as err:
                    self._staged.clear()
                    raise SlotWriteError(slot, err) from err
        index = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        self.values.index_copy_(0, index, rows.to(self.device, non_blocking=True))
        lens = torch.tensor([len(v) for v in self._staged.values()], dtype=torch.int32)
        self.lens.index_copy_(0, index, lens.to(self.device, non_blocking=True))
        self._staged.clear()

    def reserve(self, width: int) -> None:
        """Widen the table to at least `width` entries per slot now (a captured full-step graph reads it at a
        fixed address: a later widening would leave the graph on the old table,
        `framework.runner.graphs.step_graphs`)."""
        if width > self.width:
            wider = torch.zeros(self.values.shape[0], width, dtype=self.dtype, device=self.device)
            wider[:, : self.width] = self.values
            self.values = wider

    def any_in(self, req_slots: np.ndarray) -> bool:
        """Whether any of `req_slots` has a non-empty list (host check)."""
        return bool((self.host_lens[req_slots] > 0).any())
