"""Draft verification for the V2 runner: which drafted tokens a step accepts, and the draft probabilities q the
speculator returned for them, kept in their request slots until the next step verifies them."""

from __future__ import annotations

from typing import Optional

import torch

from framework.batch.input_batch import InputBatch
from framework.batch.request_state import RequestState
from framework.runner.plugins import rejection_sample
from samplers.sampler import SamplerOutput
from samplers.states import SamplingStates


class DraftVerifier:
    """Rejection sampling of each row's drafts (`verify`) and the per-slot q it reads (`store_probs`)."""

    def __init__(self, request_state: RequestState, sampling_states: SamplingStates, device: torch.device) -> None:
        self.request_state = request_state
        self.sampling_states = sampling_states
        self.device = device
        # [S, K, V] float32 q of the drafts in each slot, allocated when a speculator first returns probabilities.
        self.draft_probs: Optional[torch.Tensor] = None

    @property
    def has_probs(self) -> bool:
        """A speculator has returned draft probabilities: random rows are verified against q (the sampler must
        keep its processed logits)."""
        return self.draft_probs is not None

    def verify(self, batch: InputBatch, sampled: SamplerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, K'+1] tokens per row, [R] accepted drafts), K' = most drafts of a row this step; on the device."""
        tokens = sampled.sampled_token_ids
        if batch.num_logits == batch.num_rows:  # no drafts: every row has one logits row
            return tokens.view(batch.num_rows, 1), torch.zeros_like(batch.num_draft)
        rs = self.request_state
        max_draft = int(batch.num_draft_host.max())
        if sampled.processed_logits is None:  # drafts without probabilities, or only greedy rows
            out = rejection_sample(tokens, batch.idx_mapping, batch.cu_num_logits, rs.draft_tokens, max_draft)
        else:
            row = self.sampling_states.params.gather(batch.expanded_idx_mapping)
            out = rejection_sample(
                tokens,
                batch.idx_mapping,
                batch.cu_num_logits,
                rs.draft_tokens,
                max_draft,
                processed_logits=sampled.processed_logits,
                draft_probs=self.draft_probs,
                expanded_idx_mapping=batch.expanded_idx_mapping,
                use_q=~row.is_greedy,
                seeds=row.seed,
                positions=batch.sample_positions,
            )
        return out.tokens, out.num_accepted

    def store_probs(self, rows: torch.Tensor, probs: torch.Tensor) -> None:
        """Keep the proposal's q [R, k, V] in the req_slots `rows` [R] until the next step verifies it."""
        if self.draft_probs is None:
            k_max = self.request_state.draft_tokens.shape[1]
            self.draft_probs = torch.zeros(
                self.request_state.max_num_reqs, k_max, probs.shape[-1], dtype=torch.float32, device=self.device
            )
        self.draft_probs[rows, : probs.shape[1]] = probs.float()
