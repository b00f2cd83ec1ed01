"""Drafting with a draft head on the paged KV cache, entirely on the device (EAGLE, EAGLE-3, MTP).

After step N is verified: (1) one first pass of the head over all of step N's tokens (ids shifted by one,
see `draft_inputs`), on the head's own KV layer with the target's attention metadata (same block tables
and KV slots), which keeps the head's KV in step with the target's; (2) the head's hidden state at each row's
last accepted position gives draft 1; (3) k - 1 single-token steps, each feeding the previous draft and
hidden state back at the next position. Drafts are greedy (argmax). Nothing reads a device value on the host.
"""

from __future__ import annotations

from typing import Optional

import torch

from framework.attention import AttentionMetadata
from speculators.draft_heads import DraftHead
from speculators.draft_inputs import prepare_draft_inputs
from speculators.interface import ProposeInputs


class HeadDrafter:
    """Runs one `DraftHead` over the paged cache. `step_of(i)` picks the head step (layer) for draft i."""

    def __init__(self, head: DraftHead, max_num_reqs: int, max_model_len: int, device: torch.device,
                 aux_layer_ids: tuple[int, ...] = (), single_layer: bool = True) -> None:
        self.head = head
        self.max_model_len = max_model_len
        self.aux_layer_ids = aux_layer_ids
        self.single_layer = single_layer
        self.kv_cache: Optional[torch.Tensor] = None
        self.query_start_loc = torch.arange(max_num_reqs + 1, dtype=torch.int32, device=device)  # one token per row

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def _head_step(self, i: int) -> int:
        return 0 if self.single_layer else i

    def _target_hidden(self, inputs: ProposeInputs) -> torch.Tensor:
        if not self.aux_layer_ids:
            return inputs.hidden_states
        if len(inputs.aux_hidden_states) != len(self.aux_layer_ids):
            raise RuntimeError(f"the draft head reads target layers {self.aux_layer_ids} but the runner passed "
                               f"{len(inputs.aux_hidden_states)} aux hidden states")
        return torch.cat(inputs.aux_hidden_states, dim=-1)  # [T, n_aux * H]

    @torch.inference_mode()
    def propose(self, inputs: ProposeInputs, meta: AttentionMetadata) -> torch.Tensor:
        """[R, k] int64 greedy drafts per batch row; with k = 0 only the first pass runs (keeps the KV)."""
        batch, k = inputs.batch, inputs.num_draft_tokens
        rs = inputs.request_state
        assert self.kv_cache is not None, "bind_kv_cache before proposing"
        draft = prepare_draft_inputs(batch.input_ids, batch.query_start_loc, batch.idx_mapping, batch.seq_lens,
                                     inputs.sampled_tokens, inputs.num_sampled, inputs.num_rejected, rs.all_token_ids)
        hidden = self.head.forward_paged(draft.input_ids, self._target_hidden(inputs), batch.positions,
                                         self.kv_cache, meta, step=0)
        num_rows = batch.num_rows
        if k == 0:
            return torch.zeros(num_rows, 0, dtype=torch.int64, device=hidden.device)
        hidden = hidden[draft.last_token_index]  # [R, H]
        tokens = [self.head.draft_token_ids(hidden, self._head_step(0))]
        positions = batch.positions[draft.last_token_index]  # [R] last accepted position
        # A row that sampled nothing (prefill chunk) gets throwaway drafts and must not store KV past its chunk;
        # no row stores past the blocks it holds (the scheduler allocates ahead for drafts; without that,
        # the last drafts of a row see a stale key at their own position: worse drafts, never wrong output).
        stores = inputs.num_sampled > 0
        capacity = inputs.kv_capacity
        for i in range(1, k):
            positions = positions + 1
            store = stores if capacity is None else stores & (positions < capacity)
            step_meta = self._single_token_metadata(meta, positions, store, num_rows, batch.max_seq_len + i)
            hidden = self.head.forward_paged(tokens[-1], hidden, positions.clamp(max=self.max_model_len - 1),
                                             self.kv_cache, step_meta, step=self._head_step(i))
            tokens.append(self.head.draft_token_ids(hidden, self._head_step(i)))
        return torch.stack(tokens, dim=1)

    def _single_token_metadata(self, meta: AttentionMetadata, positions: torch.Tensor, stores: torch.Tensor,
                               num_rows: int, max_seq_len: int) -> AttentionMetadata:
        """One token per row at `positions` [R] int64, in the row's blocks (allocated ahead by the scheduler)."""
        in_range = positions < self.max_model_len
        pos = positions.clamp(max=self.max_model_len - 1)
        bs = meta.block_size
        rows = torch.arange(num_rows, device=pos.device)
        blocks = meta.block_tables[rows, pos // bs].long()
        kv_slots = torch.where(stores & in_range, blocks * bs + pos % bs, -1)
        return AttentionMetadata(
            num_tokens=num_rows, num_rows=num_rows, query_start_loc=self.query_start_loc[: num_rows + 1],
            seq_lens=(pos + 1).to(torch.int32), block_tables=meta.block_tables, kv_slot_mapping=kv_slots,
            block_size=bs, max_query_len=1, max_seq_len=min(max_seq_len, self.max_model_len),
        )
