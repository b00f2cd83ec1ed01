"""Which intervals between two outputs are one decode step's cost at k: what dynamic-k's cost model learns from.

The engine reports only when each step's output arrived (`DynamicK.observe_output`); this rule picks the
intervals that are one step's device time at one k. `speculators.dynamic.EXPLORE_STEPS` follows from it: an
exploration's first measurable step is its third.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from framework.params.scheduler_output import SchedulerOutput


class SteadySteps:
    """Which intervals between two outputs are one step's cost at k (what the cost model may learn from).

    Steady: a pure decode step whose rows all verified k drafts and proposed k for the next step, after a step
    with as many rows that verified k too (the interval holds the host's processing of that step's output), no
    request having left in between and the device busy throughout (the steps ran back to back, so the interval
    is the step's device time, drafting included). While a batch drains, requests finish every step and the
    interval carries their host work (final outputs, freed blocks) and a batch that changes shape; those steps
    would make whichever k they ran at look dear. A step that switches k carries some of each.
    """

    def __init__(self) -> None:
        self._last_time: Optional[float] = None  # when the previous output arrived (None: the device idled since)
        self._last_rows = -1
        self._last_k = -1  # drafts per row the previous step verified (-1: not a uniform decode step)
        self._request_left = False  # a request ended since the previous output

    def idle(self) -> None:
        self._last_time = None

    def request_left(self) -> None:
        self._request_left = True

    def measure(self, output: "SchedulerOutput", now: float) -> Optional[tuple[int, int, float]]:
        """(rows, k, seconds) when the step `output` scheduled, whose results arrived at `now`, was steady."""
        last, self._last_time = self._last_time, now
        rows = len(output.scheduled_request_ids)
        last_rows, self._last_rows = self._last_rows, rows
        left, self._request_left = self._request_left, False
        drafts = output.num_draft_tokens
        k = max(drafts) if drafts else 0
        # Uniform: every row verifies k drafts and computes 1 + k tokens (builtins over lists: a few us at 256 rows).
        uniform = bool(drafts) and min(drafts) == k and sum(output.num_scheduled_tokens) == rows * (1 + k)
        k = k if uniform else -1
        last_k, self._last_k = self._last_k, k
        if last is None or rows != last_rows or left or not uniform or not k == last_k == output.num_propose_tokens:
            return None
        return rows, k, now - last
