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

from framework.layers.attention import AttentionMetadata
from speculators.draft_graphs import DraftStepGraphs
from speculators.draft_heads import DraftHead
from speculators.draft_inputs import prepare_draft_inputs
from speculators.interface import ProposeInputs


class HeadDrafter:
    """Runs one `DraftHead` over the paged cache, on one KV layer: every draft runs the head's step 0 (an MTP head
    with several layers uses its first for all drafts)."""

    def __init__(
        self,
        head: DraftHead,
        max_num_reqs: int,
        max_model_len: int,
        device: torch.device,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> None:
        self.head = head
        self.max_model_len = max_model_len
        self.aux_layer_ids = aux_layer_ids
        self.kv_cache: Optional[torch.Tensor] = None
        self.graphs: Optional[DraftStepGraphs] = None  # CUDA graphs of the draft steps (GPU)
        self.query_start_loc = torch.arange(max_num_reqs + 1, dtype=torch.int32, device=device)  # one token per row

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def _target_hidden(self, inputs: ProposeInputs) -> torch.Tensor:
        if not self.aux_layer_ids:
            return inputs.hidden_states
        if len(inputs.aux_hidden_states) != len(self.aux_layer_ids):
            raise RuntimeError(
                f"the draft head reads target layers {self.aux_layer_ids} but the runner passed "
                f"{len(inputs.aux_hidden_states)} aux hidden states"
            )
        return torch.cat(inputs.aux_hidden_states, dim=-1)  # [T, n_aux * H]

    @torch.inference_mode()
    def propose(self, inputs: ProposeInputs, meta: AttentionMetadata) -> torch.Tensor:
        """[R, k] int64 greedy drafts per batch row; with k = 0 only the first pass runs (keeps the KV)."""
        batch, k = inputs.batch, inputs.num_draft_tokens
        rs = inputs.request_state
        assert self.kv_cache is not None, "bind_kv_cache before proposing"
        draft = prepare_draft_inputs(
            batch.input_ids,
            batch.query_start_loc,
            batch.idx_mapping,
            batch.seq_lens,
            inputs.sampled_tokens,
            inputs.num_sampled,
            inputs.num_rejected,
            rs.all_token_ids,
        )
        hidden = self.head.forward_paged(
            draft.input_ids, self._target_hidden(inputs), batch.positions, self.kv_cache, meta, step=0
        )
        num_rows = batch.num_rows
        if k == 0:
            return torch.zeros(num_rows, 0, dtype=torch.int64, device=hidden.device)
        hidden = hidden[draft.last_token_index]  # [R, H]
        first = self.head.draft_token_ids(hidden, 0)
        if k == 1:
            return first.unsqueeze(1)
        positions = batch.positions[draft.last_token_index]  # [R] last accepted position
        # A row that sampled nothing (prefill chunk) gets throwaway drafts and must not store KV past its chunk;
        # no row stores past the blocks it holds (the scheduler allocates ahead for drafts; without that,
        # the last drafts of a row would see a stale key at their own position: worse drafts, never wrong output).
        stores = inputs.num_sampled > 0
        capacity = inputs.kv_capacity
        if capacity is None:
            capacity = torch.full_like(inputs.num_sampled, self.max_model_len)
        size = self.graphs.padded_size(num_rows, k) if self.graphs is not None else None
        if size is not None:
            rest = self.graphs.run(
                size,
                k,
                first,
                hidden,
                positions,
                stores,
                capacity,  # type: ignore[union-attr]
                meta.block_tables,
            )
        else:
            rest = self.draft_steps(
                first, hidden, positions, stores, capacity, meta.block_tables, meta.block_size, k, batch.max_seq_len + k
            )
        return torch.cat([first.unsqueeze(1), rest], dim=1)

    def draft_steps(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        stores: torch.Tensor,
        capacity: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        k: int,
        max_seq_len: int,
    ) -> torch.Tensor:
        """[R, k - 1] drafts 2..k: each step feeds back the previous draft [R] and hidden [R, H] one position on.

        `positions` [R] int64 is each row's last accepted position, `stores` [R] bool whether the row may store
        KV, `capacity` [R] int32 the KV positions its blocks hold, `block_tables` [R, max_blocks] int32 its
        blocks, `max_seq_len` a host bound of the KV lengths (sizes attention grids). Also run inside a CUDA
        graph (`DraftStepGraphs`), so nothing here depends on device values on the host.
        """
        assert self.kv_cache is not None, "bind_kv_cache before proposing"
        out = []
        for _ in range(1, k):
            positions = positions + 1
            meta = self._single_token_metadata(
                block_tables, block_size, positions, stores & (positions < capacity), max_seq_len
            )
            hidden = self.head.forward_paged(
                tokens, hidden, positions.clamp(max=self.max_model_len - 1), self.kv_cache, meta, step=0
            )
            tokens = self.head.draft_token_ids(hidden, 0)
            out.append(tokens)
        return torch.stack(out, dim=1)

    def _single_token_metadata(
        self,
        block_tables: torch.Tensor,
        block_size: int,
        positions: torch.Tensor,
        stores: torch.Tensor,
        max_seq_len: int,
    ) -> AttentionMetadata:
        """One token per row at `positions` [R] int64 (KV slot -1 where it must not store)."""
        num_rows = positions.shape[0]
        in_range = positions < self.max_model_len
        pos = positions.clamp(max=self.max_model_len - 1)
        rows = torch.arange(num_rows, device=pos.device)
        blocks = block_tables[rows, pos // block_size].long()
        kv_slots = torch.where(stores & in_range, blocks * block_size + pos % block_size, -1)
        return AttentionMetadata(
            num_tokens=num_rows,
            num_rows=num_rows,
            query_start_loc=self.query_start_loc[: num_rows + 1],
            seq_lens=(pos + 1).to(torch.int32),
            block_tables=block_tables,
            kv_slot_mapping=kv_slots,
            block_size=block_size,
            max_query_len=1,
            max_seq_len=min(max_seq_len, self.max_model_len),
        )

    def capture_cuda_graphs(
        self, batch_sizes: list[int], max_k: int, block_size: int, max_blocks_per_req: int, dtype: torch.dtype
    ) -> None:
        """Capture the draft steps for every padded batch size and k in 2..max_k (after `bind_kv_cache`)."""
        if max_k < 2 or not batch_sizes:
            return
        self.graphs = DraftStepGraphs(
            self, batch_sizes, list(range(2, max_k + 1)), block_size, max_blocks_per_req, dtype
        )
        self.graphs.capture()
