"""Stable request slots: per-request history that lives across steps, indexed by req_slot."""

from __future__ import annotations

import numpy as np
import torch

from framework.batch.staged_writes import StagedWrites
from framework.params.scheduler_output import NewRequestData


class RequestState:
    """Owns the slot free list and the per-slot token history.

    A request takes a slot when it is first scheduled (or resumed) and keeps it until it finishes or is
    preempted; no other request's state ever moves. Adding a request overwrites every per-slot field that
    can be read: entries of `all_token_ids` past `total_len` and drafts past this step's count never are.

    Per slot: `all_token_ids` (prefill tokens, then every sampled token), `prompt_len` (the original
    prompt), `prefill_len` (prompt + output before a preemption), `total_len` (valid entries of
    `all_token_ids`), `num_computed` (tokens whose KV is cached), `last_sampled`, `draft_tokens`.

    The device tables have one row more than there are slots: row `max_num_reqs` (`graph_dummy_slot`) is
    never handed out. The padding rows of a full-step graph (`framework.runner.graphs.step_graphs`) map to it, so their
    input preparation and post-update read and write only that row.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_draft: int,
        device: torch.device,
        history_on_host: bool = False,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.graph_dummy_slot = max_num_reqs  # one past the last real slot: padding rows of full-step graphs
        self.req_id_to_slot: dict[str, int] = {}
        self.free_slots: list[int] = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out slot 0 first

        rows = max_num_reqs + 1  # + the dummy slot

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        # [S, max_model_len]. On a GPU it lives in pinned host memory by default: the kernels read and write
        # it through unified addressing, so max_num_reqs x max_model_len never occupies device memory.
        if history_on_host:
            self.all_token_ids = torch.zeros(rows, max_model_len, dtype=torch.int32, pin_memory=True)
        else:
            self.all_token_ids = zeros(rows, max_model_len)
        self.prompt_len = zeros(rows)
        self.prefill_len = zeros(rows)
        self.total_len = zeros(rows)
        self.num_computed = zeros(rows)
        self.last_sampled = zeros(rows)
        self.draft_tokens = zeros(rows, max_num_draft)  # [S+1, K]
        # Host-side upper bound of num_computed (exact without speculation): sizes attention grids, never synced.
        self.num_computed_host = np.zeros(rows, dtype=np.int64)
        self._staged = [
            StagedWrites(t, device)
            for t in (
                self.all_token_ids,
                self.prompt_len,
                self.prefill_len,
                self.total_len,
                self.num_computed,
                self.last_sampled,
            )
        ]

    @property
    def num_active(self) -> int:
        return len(self.req_id_to_slot)

    def add_request(self, new: NewRequestData) -> int:
        """Give the request a slot and stage its whole row; returns the slot."""
        if new.request_id in self.req_id_to_slot:
            raise RuntimeError(f"request '{new.request_id}' already holds slot {self.req_id_to_slot[new.request_id]}")
        if not self.free_slots:
            raise RuntimeError(f"no free request slot (max_num_reqs={self.max_num_reqs})")
        slot = self.free_slots.pop()
        self.req_id_to_slot[new.request_id] = slot
        tokens, prompt, prefill, total, computed, last = self._staged
        n = len(new.prefill_token_ids)
        tokens.stage(slot, new.prefill_token_ids)
        prompt.stage(slot, new.prompt_len)
        prefill.stage(slot, n)
        total.stage(slot, n)
        computed.stage(slot, new.num_computed_tokens)
        self.num_computed_host[slot] = new.num_computed_tokens
        last.stage(slot, new.prefill_token_ids[-1])
        return slot

    def remove_request(self, request_id: str) -> int | None:
        """Return the request's slot to the free list (its row is overwritten by the next owner)."""
        slot = self.req_id_to_slot.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return slot

    def apply_staged_writes(self) -> None:
        for staged in self._staged:
            staged.apply()
