"""Measured step cost t(B, k) for dynamic-k: seconds per decode step of B rows verifying k drafts each.

`MeasuredCostModel` keeps, per (batch-size bucket, k), the median of the last few wall times between two
consecutive outputs of pure decode steps (the engine measures it: with async scheduling the device runs the
steps back to back, so this is the step's cost, drafting and host work included). A median, not a mean: one
slow step (a garbage collection, the first replay of a CUDA graph, the host catching up after a prefill)
must not flip the policy, and a k the policy rarely uses is measured rarely.

`step_costs` turns the measurements into a full table t(B, 0..K):

* in the batch's own bucket, k between two measured k is interpolated linearly (verification and drafting
  both grow about linearly with k);
* a bucket missing k = 0 or k = K borrows the *shape* t(k) / t(0) of the nearest bucket that has both (only
  ratios between k decide the policy's argmax), scaled to whatever the bucket has measured;
* with no bucket complete, the table is unknown (None) and the policy measures k = 0 and k = K first;
* no k costs less than k = 0: verifying drafts only adds work, so a measurement that says otherwise is
  noise, and believing it would make the policy draft for nothing when acceptance is ~0.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from typing import Optional, Protocol

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


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

    def __init__(self, window: int = 5) -> None:
        self._samples: dict[tuple[int, int], deque[float]] = {}
        self.window = window

    def cost(self, num_rows: int, k: int) -> Optional[float]:
        samples = self._samples.get((batch_bucket(num_rows), k))
        return statistics.median(samples) if samples else None

    def observe(self, num_rows: int, k: int, seconds: float) -> None:
        key = (batch_bucket(num_rows), k)
        if key not in self._samples:
            self._samples[key] = deque(maxlen=self.window)
        self._samples[key].append(seconds)


def _bucket_costs(cost_model: CostModel, bucket: int, max_k: int) -> Optional[list[float]]:
    """t(bucket, 0..K) from this bucket alone: measured k, the rest interpolated; None without both ends."""
    known = {k: c for k in range(max_k + 1) if (c := cost_model.cost(bucket, k)) is not None}
    if 0 not in known or max_k not in known:
        return None
    out = []
    for k in range(max_k + 1):
        if k in known:
            out.append(known[k])
            continue
        lo = max(j for j in known if j < k)
        hi = min(j for j in known if j > k)
        out.append(known[lo] + (known[hi] - known[lo]) * (k - lo) / (hi - lo))
    return out


def step_costs(cost_model: CostModel, num_rows: int, max_k: int) -> Optional[list[float]]:
    """t(B, k) for every k in 0..max_k at this batch size (see the module docstring), or None."""
    costs = _raw_step_costs(cost_model, num_rows, max_k)
    return None if costs is None else [max(c, costs[0]) for c in costs]


def _raw_step_costs(cost_model: CostModel, num_rows: int, max_k: int) -> Optional[list[float]]:
    bucket = batch_bucket(num_rows)
    own = _bucket_costs(cost_model, bucket, max_k)
    if own is not None:
        return own
    by_distance = sorted(BATCH_BUCKETS, key=lambda b: abs(math.log2(b) - math.log2(bucket)))
    for other in by_distance:
        shape = _bucket_costs(cost_model, other, max_k) if other != bucket else None
        if shape is None:
            continue
        measured = {k: c for k in range(max_k + 1) if (c := cost_model.cost(bucket, k)) is not None}
        # Scale the borrowed shape to this bucket's own measurements (their mean ratio), if any.
        scale = (sum(c / shape[k] for k, c in measured.items()) / len(measured)) if measured else 1.0
        return [measured.get(k, shape[k] * scale) for k in range(max_k + 1)]
    return None
