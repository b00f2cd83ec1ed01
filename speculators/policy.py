"""How many drafts to verify next step (k), decided on the host by the scheduler, and what it learns from.

The scheduler asks `choose(request_ids)` (the running requests) once per step for the k the speculator
proposes after the step (`SchedulerOutput.num_propose_tokens`), reports each finished step's per-row
acceptance (`observe_acceptance`) and each ended request (`remove_request`); the engine reports when each
step's output arrived (`observe_output`) and when the device ran out of work (`device_idled`), from which a
policy that weighs step costs measures them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from framework.params.scheduler_output import SchedulerOutput


class DraftLengthPolicy(ABC):
    """Picks k in [0, max_k] for the next step; the default methods ignore what they observe."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k

    @abstractmethod
    def choose(self, request_ids: Sequence[str]) -> int:
        """k for the step after this one, given the requests running now (about one decode row each)."""

    def observe_acceptance(
        self, request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int]
    ) -> None:
        """One finished step: per row that verified drafts, its request, drafts verified and leading drafts
        accepted."""

    def observe_output(self, output: "SchedulerOutput") -> None:
        """The results of the step `output` scheduled have just reached the host (before the scheduler reads them)."""

    def device_idled(self) -> None:
        """No step was in flight: the time until the next output is not a step's cost."""

    def remove_request(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed): forget what was learnt about it."""


class FixedK(DraftLengthPolicy):
    """Always `max_k` (the configured `num_speculative_tokens`)."""

    def choose(self, request_ids: Sequence[str]) -> int:
        return self.max_k
