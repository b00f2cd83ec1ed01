"""Measured step cost t(B, k) for dynamic-k: seconds per decode step of B rows verifying k drafts each.

`MeasuredCostModel` keeps, per (batch-size bucket, k), the median of the last few wall times between two
consecutive outputs of pure decode steps (the engine measures it: with async scheduling the device runs the
steps back to back, so this is the step's cost, drafting and host work included). A median, not a mean: one
slow step (a garbage collection, the first replay of a CUDA graph, the host catching up after a prefill)
must not flip the policy, and a k the policy rarely uses is measured rarely.

`step_costs` turns the measurements into a full table t(B, 0..K):

* in the batch's own bucket, k = 0 keeps its own median, and k >= 1 lie on a line t(k) = a + b * k fitted by
  least squares to their per-k medians (two measured k >= 1 suffice). k = 0 stands apart because drafting
  at all has a fixed cost (the proposer runs, verification rows replace plain decode rows): measured on an
  H200 at batch 1, k = 1 costs 25 % more than k = 0 while k = 1..5 differ by a few %. Steps of a few ms
  are host-bound and measure with 5-15 % noise per k; pooling every k >= 1 into one line keeps that noise
  from ranking, say, k = 4 below k = 5. b is kept >= 0 and no k >= 1 is taken to cost less than k = 0:
  verifying drafts only adds work, so a measurement saying otherwise is noise, and believing it would make
  the policy draft for nothing when acceptance is ~0. With k = 0 and a single k >= 1 measured, the table is
  the line through the two;
* with a single k measured in every bucket that has any, the table is `prior_shape` scaled to the nearest: drafting at
all costs 25 % of a step
  and each draft 2 % more (what an H200 measured at batch 1-16; at 256, k = 1 and 5 cost 16 % and 36 %
  more). A large fixed cost is the cautious side: drafting must then earn it by measured acceptance;
* a bucket without such a table borrows the *shape* t(k) / t(0) of the nearest bucket that has one (only
  ratios between k decide the policy's argmax), scaled to whatever the bucket has measured;
* with nothing measured anywhere, it is unknown (None) and the policy measures k = K first.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Optional, Protocol

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
PRIOR_DRAFT_COST, PRIOR_DRAFT_SLOPE = 0.25, 0.02  # prior_shape: t(k) / t(0) = 1 + 0.25 + 0.02 (k - 1), k >= 1


def prior_shape(max_k: int) -> list[float]:
    """t(k) / t(0) for k in 0..max_k assumed until a second k is measured (see the module docstring)."""
    return [1.0] + [1.0 + PRIOR_DRAFT_COST + PRIOR_DRAFT_SLOPE * (k - 1) for k in range(1, max_k + 1)]


def batch_bucket(num_rows: int) -> int:
    """The smallest bucket >= num_rows (the largest bucket for anything bigger)."""
    i = bisect.bisect_left(BATCH_BUCKETS, max(num_rows, 1))
    return BATCH_BUCKETS[min(i, len(BATCH_BUCKETS) - 1)]


class CostModel(Protocol):
    """Seconds per step of `num_rows` decode rows verifying `k` drafts each (None = not known yet)."""

    def cost(self, num_rows: int, k: int) -> Optional[float]: ...

    def observe(self, num_rows: int, k: int, seconds: float) -> None: ...


class MeasuredCostModel:
    """The median of the last `window` measured step times per (batch bucket, k)."""

    def __init__(self, window: int = 7) -> None:
        self._samples: dict[tuple[int, int], deque[float]] = {}
        self._medians: dict[tuple[int, int], float] = {}  # computed on demand, dropped when a sample arrives
        self.window = window
        self._last: tuple[int, int, Optional[tuple[int, int]]] = (-1, -1, None)  # (rows, k, key) of the last observe
        self.num_observed = 0  # steps observed so far (a policy need not re-decide on costs that did not change)

    def cost(self, num_rows: int, k: int) -> Optional[float]:
        key = (batch_bucket(num_rows), k)
        median = self._medians.get(key)
        if median is None:
            samples = self._samples.get(key)
            if not samples:
                return None
            ordered, n = sorted(samples), len(samples)  # the median (statistics.median is several times slower)
            median = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
            self._medians[key] = median
        return median

    def observe(self, num_rows: int, k: int, seconds: float) -> None:
        rows, last_k, key = self._last
        if key is None or rows != num_rows or last_k != k:  # steady steps repeat (rows, k): no bucket lookup then
            key = (batch_bucket(num_rows), k)
            self._last = (num_rows, k, key)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=self.window)
        samples.append(seconds)
        self._medians.pop(key, None)
        self.num_observed += 1

    def __bool__(self) -> bool:
        return bool(self._samples)


def _line(points: dict[int, float]) -> tuple[float, float]:
    """(a, b) of the least-squares line t = a + b * k through >= 2 points {k: t}, with b >= 0."""
    mean_k = sum(points) / len(points)
    mean_t = sum(points.values()) / len(points)
    slope = sum((k - mean_k) * (t - mean_t) for k, t in points.items()) / sum((k - mean_k) ** 2 for k in points)
    slope = max(slope, 0.0)  # verifying more drafts never costs less: a negative slope is noise
    return mean_t - slope * mean_k, slope


def _bucket_table(cost_model: CostModel, bucket: int, max_k: int, prior: bool = False) -> Optional[list[float]]:
    """t(0..max_k) from this bucket's own per-k medians (see the module docstring), or None with too few; with
    `prior`, a single measured k gives the prior shape through it."""
    points = {k: c for k in range(max_k + 1) if (c := cost_model.cost(bucket, k)) is not None}
    drafting = {k: c for k, c in points.items() if k > 0}
    if len(drafting) >= 2:
        a, b = _line(drafting)
        t0 = points.get(0, a)
        return [t0] + [max(a + b * k, t0) for k in range(1, max_k + 1)]
    if len(points) == 2:  # k = 0 and one k >= 1: the line through both
        a, b = _line(points)
        return [a + b * k for k in range(max_k + 1)]
    if prior and len(points) == 1:  # the prior shape through the one measured k
        ((k, c),) = points.items()
        shape = prior_shape(max_k)
        return [c / shape[k] * x for x in shape]
    return None


def has_own_costs(cost_model: CostModel, num_rows: int, max_k: int) -> bool:
    """Whether this batch size's bucket has measured enough for a table of its own (nothing borrowed)."""
    return bool(cost_model) and _bucket_table(cost_model, batch_bucket(num_rows), max_k) is not None


def step_costs(cost_model: CostModel, num_rows: int, max_k: int) -> Optional[list[float]]:
    """t(B, k) for every k in 0..max_k at this batch size (see the module docstring), or None."""
    if not cost_model:  # nothing measured anywhere (a model without samples is falsy)
        return None
    bucket = batch_bucket(num_rows)
    table = _bucket_table(cost_model, bucket, max_k)
    if table is not None:
        return table
    by_distance = sorted(BATCH_BUCKETS, key=lambda b: abs(math.log2(b) - math.log2(bucket)))
    for other in by_distance:
        borrowed = _bucket_table(cost_model, other, max_k) if other != bucket else None
        if borrowed is None or borrowed[0] <= 0.0:
            continue
        shape = [t / borrowed[0] for t in borrowed]  # t(k) / t(0) there
        measured = {k: c for k in range(max_k + 1) if (c := cost_model.cost(bucket, k)) is not None}
        # Scale the borrowed shape to this bucket's own measurement, if it has one.
        base = sum(c / shape[k] for k, c in measured.items()) / len(measured) if measured else borrowed[0]
        return [base * x for x in shape]
    for other in by_distance:  # no bucket has two k measured: the prior shape, here or from the nearest bucket
        table = _bucket_table(cost_model, other, max_k, prior=True)
        if table is not None:
            return table
    return None
