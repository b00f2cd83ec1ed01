"""The Speculator boundary: draft proposals that stay on the device between steps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from framework.input_batch import InputBatch
    from framework.request_state import RequestState
    from framework.scheduler_output import NewRequestData


class Speculator(ABC):
    """Proposes up to `num_speculative_tokens` drafts per request after each step.

    Hook points in the runner: per-slot verbs like every state owner, then `propose` after the post-update,
    which writes drafts into `RequestState.draft_tokens` on the device; the next step's input preparation
    reads them through `idx_mapping` and the rejection sampler verifies them through `expanded_idx_mapping`.
    """

    name: str = "base"

    def __init__(self, num_speculative_tokens: int, max_num_reqs: int, device: torch.device) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_num_reqs = max_num_reqs
        self.device = device

    def add_request(self, req_slot: int, request: "NewRequestData") -> None:
        """A request took `req_slot`."""

    def remove_request(self, req_slot: int) -> None:
        """The request in `req_slot` left."""

    def apply_staged_writes(self) -> None:
        """Apply this step's staged per-slot writes."""

    @abstractmethod
    def propose(
        self,
        batch: "InputBatch",
        hidden_states: torch.Tensor,  # [T, hidden]: the target model's last hidden states this step
        num_sampled: torch.Tensor,  # [R] int32: tokens each row produced this step
        request_state: "RequestState",
    ) -> torch.Tensor:
        """[R, num_speculative_tokens] int32 drafts per batch row (no host sync)."""
