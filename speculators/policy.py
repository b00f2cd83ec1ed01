"""How many drafts to verify next step (k), decided on the host by the scheduler, and what it learns from.

The scheduler asks `choose(request_ids)` (the running requests) once per step for the k the speculator
proposes after the step (`SchedulerOutput.num_propose_tokens`), reports each finished step's per-row
acceptance (`observe_acceptance`) and each ended request (`remove_request`); the engine reports how long each
pure decode step took (`observe_step`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence


class DraftLengthPolicy(ABC):
    """Picks k in [0, max_k] for the next step; the default methods ignore what they observe."""

    wants_step_times = False  # whether the engine should time steps for `observe_step` (host work per step)

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k

    @abstractmethod
    def choose(self, request_ids: Sequence[str]) -> int:
        """k for the step after this one, given the requests running now (about one decode row each)."""

    def observe_acceptance(self, request_ids: Sequence[str], num_draft: Sequence[int],
                           num_accepted: Sequence[int]) -> None:
        """One finished step: per row that verified drafts, its request, drafts verified and leading drafts
        accepted."""

    def observe_step(self, num_rows: int, k: int, seconds: float) -> None:
        """A pure decode step of `num_rows` rows verifying up to `k` drafts each took `seconds`."""

    def remove_request(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed): forget what was learnt about it."""


class FixedK(DraftLengthPolicy):
    """Always `max_k` (the configured `num_speculative_tokens`)."""

    def choose(self, request_ids: Sequence[str]) -> int:
        return self.max_k

