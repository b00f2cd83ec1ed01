"""Dynamic-k: choose the number of drafts every step to maximise expected accepted tokens per second.

With E_r(k) the expected tokens request r yields per step when verifying k drafts (`speculators.acceptance`)
and t(B, k) the measured seconds per step of B decode rows verifying k drafts each, drafting included
(`speculators.step_cost`), the policy picks

    argmax_k  mean_r E_r(k) / t(B, k)        over k in [0, max_k]  (k = 0: no speculation)

over the requests running now, preferring the smaller k unless a larger one is at least `MARGIN` better, and
among drafting k the one in use unless another is at least `MARGIN` better (host-bound steps of a few ms
measure with a few percent of noise; a switch for less only flaps).
Both inputs are measured online: acceptance per draft position, batch-wide and per request (a request's
own rates lean on the batch-wide ones until it has been observed), and step costs per batch-size bucket.
With no measured costs anywhere, the policy first runs max_k (its cost, and the acceptance of every draft
position), then decides with a prior cost shape scaled to it; a new bucket borrows the cost shape of the
nearest measured one. The decision is remade every `DECIDE_EVERY_STEADY` steps, whenever the batch changes
size bucket (then every `DECIDE_EVERY` steps for a while if the bucket has no costs of its own yet, and so at
the start) and right after an exploration; in between, a step costs a counter test (the host often bounds a
step, and a decision costs 0.1-1 ms of it). Every `explore_every` steps the policy tries the k it has not used
for longest (or, every other time while below max_k, max_k itself, which observes every draft position), so
costs and acceptance keep tracking a workload that changes; explorations that cost much are spaced further
apart (`EXPLORE_BUDGET`); that schedule is `speculators.explorations.Explorations`. Tests inject a synthetic
`CostModel` instead of the measured one.

Which steps are measured is decided by `speculators.steady_steps.SteadySteps`, whose rule dictates the
exploration length (`EXPLORE_STEPS`): the engine only reports when each output arrived.
`speculator.dynamic_k: true` puts this policy over any drafting method; the method proposes however many drafts
it is asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import numpy as np

from speculators.acceptance import AcceptanceTracker, Queued, Removal, RequestAcceptance, fold_queue

# The exploration schedule and its constants (still importable from here: `speculators.dynamic.EXPLORE_STEPS`).
from speculators.explorations import EXPLORE_BUDGET, EXPLORE_STEPS, Explorations  # noqa: F401
from speculators.policy import DraftLengthPolicy, FixedK
from speculators.steady_steps import SteadySteps
from speculators.step_cost import CostModel, MeasuredCostModel, batch_bucket, has_own_costs, step_costs

if TYPE_CHECKING:
    from framework.config.schema import SpeculatorConfig
    from framework.params.scheduler_output import SchedulerOutput

MARGIN = 0.03  # a larger k must beat a smaller one by 3% in expected tokens/s: no flapping on noise
# Steps between two decisions at the same batch-size bucket: DECIDE_EVERY for SETTLE steps after the first decision
# and after the batch changed to a bucket without costs of its own (they are being measured), DECIDE_EVERY_STEADY
# otherwise, and once right after an exploration.
# A decision costs 0.1-0.4 ms of host time (acceptance folded, costs fitted), on the step path of a host that
# is often the bottleneck: on an H200 every 4th step of a 2 ms batch-16 decode was 0.4 ms slower when the
# policy decided every 4 steps.
DECIDE_EVERY, DECIDE_EVERY_STEADY, SETTLE = 4, 32, 16
# The decision after an exploration that started at step e comes at e + EXPLORE_STEPS + 1: `SteadySteps` measures
# the exploration's last step whose drafts were proposed and verified at the explored k (proposed at e + 2,
# verified at e + 3), when its output arrives, after step e + 3 is scheduled.
DECIDE_AFTER_EXPLORE = EXPLORE_STEPS + 1
MAX_QUEUED = 128  # observations and removals queued between two folds before one is forced


class Decision(NamedTuple):
    """One step's choice, as `DynamicK(record=True)` logs it (benchmarks dump the log to explain a run)."""

    step: int
    num_rows: int
    k: int
    reason: str  # "decide" (rates recomputed), "keep" (last decision reused), "explore", "measure" (no costs yet)
    rates: tuple[float, ...]  # expected tokens/s per row and k at the last decision (empty on "keep" steps)
    costs_ms: tuple[float, ...]  # t(B, k) per k at a decision (else empty)
    acceptance: tuple[float, ...]  # batch-wide conditional acceptance per draft position, at a decision


@dataclass
class _LastDecision:
    """The last decision, what it was made with, and when the next one is due besides the regular cadence."""

    best: Optional[int] = None  # None: nothing measured yet
    bucket: int = 0  # batch-size bucket it was made at
    rates: list[float] = field(default_factory=list)  # expected tokens/s per k
    costs: list[float] = field(default_factory=list)  # t(B, k) per k
    acceptance: np.ndarray = field(default_factory=lambda: np.zeros(0))  # batch-wide acceptance per draft position
    observed: Optional[int] = None  # the cost model's `num_observed` then
    settle_until: int = 0  # decide every DECIDE_EVERY steps until this step
    extra_at: int = 0  # a decision due at this step too (right after an exploration)


class DynamicK(DraftLengthPolicy):
    """The policy of the module docstring."""

    def __init__(
        self,
        max_k: int,
        cost_model: Optional[CostModel] = None,
        acceptance_decay: float = 0.95,
        prior_acceptance: float = 0.5,
        explore_every: int = 32,
        record: bool = False,
    ) -> None:
        super().__init__(max_k)
        self.cost_model: CostModel = cost_model if cost_model is not None else MeasuredCostModel()
        self.acceptance = AcceptanceTracker(max_k, acceptance_decay, prior_acceptance)
        self.requests = RequestAcceptance(max_k, acceptance_decay)
        # Benchmarks only (record=True): every step's k and why. Off in the engine, where a list growing by one
        # entry per step would leak in a long-running server.
        self.decisions: Optional[list[Decision]] = [] if record else None
        self._steps = 0
        self._k = 0  # the k chosen last step
        self._last_used = [-1] * (max_k + 1)  # step at which each k was last chosen
        self._queue: list[Queued] = []  # observations and removals since the last decision, as they came
        self._last = _LastDecision(acceptance=np.zeros(max_k))
        self._explore = Explorations(max_k, explore_every)
        self._steady = SteadySteps()

    @classmethod
    def from_config(cls, config: "SpeculatorConfig", cost_model: Optional[CostModel] = None) -> "DynamicK":
        d = config.dynamic
        return cls(config.num_speculative_tokens, cost_model, d.acceptance_decay, d.prior_acceptance, d.explore_every)

    @property
    def explore_every(self) -> int:
        """Steps between two explorations (0: none), before the spacing of costly ones."""
        return self._explore.every

    @property
    def history(self) -> Optional[list[int]]:
        """Every k chosen, in order (with `record=True`, else None)."""
        return None if self.decisions is None else [d.k for d in self.decisions]

    def costs(self, num_rows: int) -> Optional[list[float]]:
        """t(B, k) for every k (see `speculators.step_cost.step_costs`), None while nothing is measured."""
        return step_costs(self.cost_model, num_rows, self.max_k)

    def expected_tokens(self, request_ids: Sequence[str]) -> list[float]:
        """E(0..max_k): expected tokens per row and step, the mean over these requests."""
        self.fold_observations()
        self._last.acceptance = self.acceptance.rates()
        return self.requests.expected_tokens(request_ids, self._last.acceptance).tolist()

    def fold_observations(self) -> None:
        """Add the queued observations and removals to the acceptance counts (done when a decision reads them;
        a step itself only queues)."""
        if self._queue:
            queue, self._queue = self._queue, []
            fold_queue(queue, self.requests, self.acceptance)

    def rates(self, request_ids: Sequence[str]) -> Optional[list[float]]:
        """Expected tokens per second for every k, or None while the costs at this batch size are unknown."""
        costs = self.costs(len(request_ids))
        if costs is None:
            return None
        self._last.costs = costs
        tokens = self.expected_tokens(request_ids)
        return [tokens[k] / max(costs[k], 1e-12) for k in range(self.max_k + 1)]

    def best_k(self, request_ids: Sequence[str], current: Optional[int] = None) -> Optional[int]:
        """argmax of expected tokens per second, or None while the costs at this batch size are unknown. A
        larger k must be `MARGIN` better to be taken, and so must another drafting k than `current` (the k
        in use) when that drafts too. Between drafting and not, the smaller-k rule alone decides: a drafting
        k kept by inertia when the estimates tie would draft for nothing."""
        rates = self.rates(request_ids)
        if rates is None:
            return None
        self._last.rates = rates
        best = 0
        for k in range(1, self.max_k + 1):
            if rates[k] > rates[best] * (1 + MARGIN):
                best = k
        if current and best and rates[best] <= rates[current] * (1 + MARGIN):
            return current  # no switch between two drafting k for a gain within the noise
        return best

    def choose(self, request_ids: Sequence[str]) -> int:
        self._steps += 1
        self._last_used[self._k] = self._steps - 1
        k, reason = self._choose(request_ids)
        self._k, self._last_used[k] = k, self._steps
        if self.decisions is not None:  # what the decision used, nothing recomputed (host time is measured)
            if reason == "keep":
                self.decisions.append(Decision(self._steps, len(request_ids), k, reason, (), (), ()))
            else:
                decided, last = reason == "decide", self._last
                self.decisions.append(
                    Decision(
                        self._steps,
                        len(request_ids),
                        k,
                        reason,
                        tuple(round(r, 1) for r in last.rates),
                        tuple(round(1e3 * c, 3) for c in last.costs) if decided else (),
                        tuple(round(float(a), 3) for a in last.acceptance) if decided else (),
                    )
                )
        return k

    def _choose(self, request_ids: Sequence[str]) -> tuple[int, str]:
        """(k, why: see `Decision.reason`)."""
        if self.max_k == 0 or not request_ids:
            return 0, "keep"
        last = self._last
        held = self._explore.hold()
        if held is not None:  # an exploration holds its k (see EXPLORE_STEPS)
            return held, "explore"
        # Decide at once when the batch changes bucket, then every DECIDE_EVERY steps while settling and every
        # DECIDE_EVERY_STEADY steps after: a decision costs 0.1-1 ms of host time, against steps of 1-8 ms.
        bucket = batch_bucket(len(request_ids))
        if bucket != last.bucket and (
            last.best is None or not has_own_costs(self.cost_model, len(request_ids), self.max_k)
        ):
            last.settle_until = self._steps + SETTLE  # acceptance or costs are still being measured: decide often
        every = DECIDE_EVERY if self._steps < last.settle_until else DECIDE_EVERY_STEADY
        # A settling decision (every DECIDE_EVERY steps) is skipped when no step was measured since the last one:
        # while a batch drains, rows finish every step and no step is steady, so there is nothing new to use.
        observed = getattr(self.cost_model, "num_observed", None)  # None: a cost model that does not count
        nothing_new = every == DECIDE_EVERY and observed is not None and observed == last.observed
        decide = (
            last.best is None
            or bucket != last.bucket
            or self._steps == last.extra_at
            or (self._steps % every == 0 and not nothing_new)
        )
        if decide:
            last.best, last.bucket = self.best_k(request_ids, last.best), bucket
            last.observed = observed
        if last.best is None:  # nothing measured yet: max_k (measures its cost and every position's acceptance)
            return self.max_k, "measure"
        explored = self._explore.start_if_due(self._steps, last.best, last.rates, self._last_used)
        if explored is not None:
            last.extra_at = self._steps + DECIDE_AFTER_EXPLORE  # what it measured is used at once
            return explored, "explore"
        return last.best, "decide" if decide else "keep"

    def observe_acceptance(
        self, request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int]
    ) -> None:
        self._queue.append((request_ids, num_draft, num_accepted))  # folded at the next decision
        if len(self._queue) > MAX_QUEUED:
            self.fold_observations()

    def observe_output(self, output: "SchedulerOutput") -> None:
        steady = self._steady.measure(output, time.perf_counter())
        if steady is not None:
            self.observe_step(*steady)

    def device_idled(self) -> None:
        self._steady.idle()

    def observe_step(self, num_rows: int, k: int, seconds: float) -> None:
        """A steady decode step of `num_rows` rows verifying `k` drafts each took `seconds` (see `SteadySteps`)."""
        self.cost_model.observe(num_rows, k, seconds)

    def remove_request(self, request_id: str) -> None:
        self._queue.append(Removal(request_id))  # in order: its queued observations are added first
        self._steady.request_left()


def build_draft_policy(config: "SpeculatorConfig") -> Optional[DraftLengthPolicy]:
    """None without speculation, the dynamic-k policy with `speculator.dynamic_k`, else a fixed k."""
    if config.method == "none":
        return None
    if config.dynamic_k:
        return DynamicK.from_config(config)
    return FixedK(config.num_speculative_tokens)
