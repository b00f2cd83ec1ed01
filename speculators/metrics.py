"""Speculative decoding counters, accumulated on the host from each step's output."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class SpecDecodeMetrics:
    """Counts since the engine started (or since `reset`).

    A *draft* is one row verifying at least one draft token; `accepted_per_position[j]` counts drafts whose
    token j was accepted (all of 0..j accepted), `drafted_per_position[j]` those that had a token j.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int, times: int = 1) -> None:
        """`times` rows each verified `num_draft` drafts and accepted the first `num_accepted`."""
        if num_draft <= 0 or times <= 0:
            return
        self.num_drafts += times
        self.num_draft_tokens += times * num_draft
        self.num_accepted_tokens += times * num_accepted
        grow = num_draft - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(num_draft):
            self.drafted_per_position[j] += times
            if j < num_accepted:
                self.accepted_per_position[j] += times

    def record_step(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step's rows (`record` per row): rows with the same counts are counted together, so a step of
        256 rows verifying k drafts costs a few dozen updates, not 256 * k (it runs on the host every step)."""
        for (d, a), times in Counter(zip(num_draft, num_accepted)).items():
            self.record(d, a, times)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying row and step: 1 (the target's own token) + accepted drafts per draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of drafts whose token j was accepted, per position j."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers for JSON and tables."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
        }
