"""Dynamic-k's explorations: which k it tries instead of its best, for how long, and how far apart.

Every `explore_every` steps `speculators.dynamic.DynamicK` runs another k than the one it decided on for
`EXPLORE_STEPS` steps, so that the measured step costs and acceptance rates of every k keep tracking a
workload that changes. Below max_k every other exploration drafts max_k (one step observes the acceptance of
every draft position); otherwise it runs the k unused for longest. An exploration that costs much of the
tokens per second is spaced further apart, so that explorations cost about `EXPLORE_BUDGET` of them.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

# An exploration holds its k this many steps: a step is measured only when it verified and proposed the same k
# as the step before it (`SteadySteps`: the interval also carries the host's processing of the previous output,
# whose size follows that step's k), so the third step of an exploration is the first one measured.
EXPLORE_STEPS = 3
EXPLORE_BUDGET = 0.01  # exploration steps may cost about this fraction of the tokens per second


class Explorations:
    """The exploration schedule of one `DynamicK`: `count` explorations so far, the last started at step
    `last_at` (0: none yet), the next considered at step `next_at`; the one in progress runs `k` for `left`
    more steps."""

    def __init__(self, max_k: int, explore_every: int) -> None:
        self.max_k, self.every = max_k, explore_every
        self.count = 0
        self.next_at = explore_every
        self.last_at = 0
        self.k = 0
        self.left = 0

    def hold(self) -> Optional[int]:
        """The k of the exploration in progress, for one more of its steps; None when none is in progress."""
        if not self.left:
            return None
        self.left -= 1
        return self.k

    def start_if_due(self, step: int, best: int, rates: Sequence[float], last_used: Sequence[int]) -> Optional[int]:
        """At `step`, with `best` the k decided on, `rates` the expected tokens/s per k at that decision (may be
        empty) and `last_used` the step each k was last chosen: the k of an exploration that starts now and holds
        for EXPLORE_STEPS steps (this one included), or None."""
        if not self.every or step < self.next_at:
            return None
        k = self._next_k(best, last_used)
        due = self.last_at + self._spacing(k, best, rates)
        if step < due:
            self.next_at = due  # dear for what it would tell: later
            return None
        # It holds for EXPLORE_STEPS steps: a step's cost is verifying its drafts plus proposing the next step's
        # plus the host's processing of the previous output, and only the last step of an exploration has all
        # three at the explored k (`SteadySteps` measures only such steps).
        self.count += 1
        self.last_at = step
        self.next_at = step + self.every
        self.k, self.left = k, EXPLORE_STEPS - 1
        return k

    def _next_k(self, best: int, last_used: Sequence[int]) -> int:
        """The k the next exploration runs. Below max_k, every other exploration drafts max_k: one step measures
        the acceptance of every position (the current k observes only its own). Otherwise the k unused for
        longest, to refresh its measured cost."""
        if best < self.max_k and self.count % 2 == 0:
            return self.max_k
        others = [j for j in range(self.max_k + 1) if j != best]
        return min(others, key=lambda j: last_used[j])

    def _spacing(self, k: int, best: int, rates: Sequence[float]) -> int:
        """Steps from one exploration to an exploration of k: `explore_every`, or more when k is dear. Running
        k instead of the best for EXPLORE_STEPS steps loses a fraction L of a step's tokens per second each
        step; spaced EXPLORE_STEPS * L / EXPLORE_BUDGET apart, explorations cost EXPLORE_BUDGET of the tokens
        per second (at batch 256 with acceptance ~0, a step at max_k costs about twice a step at k = 0). The
        first exploration, when it drafts max_k above the best k, is not spaced: in a batch mixing requests
        that accept with many that do not, it is what finds the former before the latter finish."""
        if self.count == 0 and k == self.max_k > best:
            return self.every
        loss = max(0.0, 1.0 - rates[k] / max(rates[best], 1e-12)) if rates else 0.0
        return max(self.every, math.ceil(EXPLORE_STEPS * loss / EXPLORE_BUDGET))
