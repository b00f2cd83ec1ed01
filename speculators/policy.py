"""How many drafts to verify next step (k), decided on the host by the scheduler, and what it learns from.

The scheduler asks `choose(num_decode_rows)` once per step for the k the speculator proposes after the step
(`SchedulerOutput.num_propose_tokens`); the engine reports each finished step's per-row acceptance
(`observe_acceptance`) and, for pure decode steps, how long the step took (`observe_step`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from framework.config import SpeculatorConfig


class DraftLengthPolicy(ABC):
    """Picks k in [0, max_k] for the next step; the default methods ignore what they observe."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k

    @abstractmethod
    def choose(self, num_decode_rows: int) -> int:
        """k for the step after this one, given about `num_decode_rows` requests decoding."""

    def observe_acceptance(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One finished step: drafts verified and leading drafts accepted, per row that verified any."""

    def observe_step(self, num_rows: int, k: int, seconds: float) -> None:
        """A pure decode step of `num_rows` rows verifying up to `k` drafts each took `seconds`."""


class FixedK(DraftLengthPolicy):
    """Always `max_k` (the configured `num_speculative_tokens`)."""

    def choose(self, num_decode_rows: int) -> int:
        return self.max_k


def build_draft_policy(config: "SpeculatorConfig") -> Optional[DraftLengthPolicy]:
    """None without speculation, the dynamic-k policy for `method: dynamic`, else a fixed k."""
    if config.method == "none":
        return None
    if config.method == "dynamic":
        from speculators.dynamic import DynamicK

        return DynamicK.from_config(config)
    return FixedK(config.num_speculative_tokens)
