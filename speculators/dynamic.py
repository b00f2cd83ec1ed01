"""Dynamic-k: choose the number of drafts every step to maximise expected accepted tokens per second.

With a_j the measured acceptance of draft position j given positions 0..j-1 were accepted, a row verifying
k drafts yields on average

    E(k) = 1 + sum_{j=1..k} prod_{i<j} a_i        tokens per step,

and a step of B decode rows verifying k drafts each costs t(B, k) seconds (drafting included). The policy
picks argmax_k B * E(k) / t(B, k) over k in [0, max_k] (k = 0: no speculation), preferring the smaller k
unless a larger one is at least `MARGIN` better. Both inputs are measured online:

* `AcceptanceTracker`: per-position moving averages of accepted / attempted, updated from each step's output
  on the host; the averages decay every step, so a position that is no longer measured drifts back to the
  prior and gets tried again.
* `MeasuredCostModel`: a moving average of the wall time of pure decode steps per (batch-size bucket, k).
  At a new batch-size bucket the policy first measures k = 0 and k = max_k; costs of the k in between are
  interpolated linearly until they are measured (verification and drafting both grow about linearly with
  k). Every `explore_every` steps the policy re-tries the k it has not used for longest, so costs and
  acceptance keep tracking a workload that changes. Tests inject a synthetic `CostModel` instead.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from speculators.interface import Proposal, ProposeInputs, Speculator
from speculators.policy import DraftLengthPolicy

if TYPE_CHECKING:
    import torch

    from framework.config import SpeculatorConfig
    from framework.engine_setup import LoadedModel
    from framework.scheduler_output import NewRequestData

MARGIN = 0.01  # a larger k must beat a smaller one by 1% in expected tokens/s: no flapping on noise
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class CostModel(Protocol):
    """Seconds per step of `num_rows` decode rows verifying `k` drafts each (None = not known yet)."""

    def cost(self, num_rows: int, k: int) -> Optional[float]: ...

    def observe(self, num_rows: int, k: int, seconds: float) -> None: ...


def batch_bucket(num_rows: int) -> int:
    """The smallest bucket >= num_rows (the largest bucket for anything bigger)."""
    i = bisect.bisect_left(BATCH_BUCKETS, max(num_rows, 1))
    return BATCH_BUCKETS[min(i, len(BATCH_BUCKETS) - 1)]


class MeasuredCostModel:
    """Moving average of measured step times per (batch bucket, k); `decay` weighs the old average."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self._seconds: dict[tuple[int, int], float] = {}

    def cost(self, num_rows: int, k: int) -> Optional[float]:
        return self._seconds.get((batch_bucket(num_rows), k))

    def observe(self, num_rows: int, k: int, seconds: float) -> None:
        key = (batch_bucket(num_rows), k)
        old = self._seconds.get(key)
        self._seconds[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds


class AcceptanceTracker:
    """Per-position conditional acceptance a_j as decayed counts, pulled towards `prior` by one pseudo-count."""

    def __init__(self, max_k: int, decay: float, prior: float) -> None:
        self.decay = decay
        self.prior = prior
        self.accepted = [0.0] * max_k
        self.attempted = [0.0] * max_k

    def tick(self) -> None:
        """One step passed: older observations weigh less."""
        self.accepted = [x * self.decay for x in self.accepted]
        self.attempted = [x * self.decay for x in self.attempted]

    def observe(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        for d, a in zip(num_draft, num_accepted):
            # Position j was attempted when the row had a draft j and drafts 0..j-1 were accepted.
            for j in range(min(d, a + 1, len(self.attempted))):
                self.attempted[j] += 1.0
                self.accepted[j] += j < a

    def rates(self) -> list[float]:
        return [(acc + self.prior) / (att + 1.0) for acc, att in zip(self.accepted, self.attempted)]

    def expected_tokens(self, k: int) -> float:
        """E(k): expected tokens a row produces per step when verifying k drafts."""
        total, reach = 1.0, 1.0
        for a in self.rates()[:k]:
            reach *= a
            total += reach
        return total


class DynamicK(DraftLengthPolicy):
    """The policy of the module docstring."""

    def __init__(self, max_k: int, cost_model: Optional[CostModel] = None, acceptance_decay: float = 0.95,
                 prior_acceptance: float = 0.5, explore_every: int = 16) -> None:
        super().__init__(max_k)
        self.cost_model: CostModel = cost_model if cost_model is not None else MeasuredCostModel()
        self.acceptance = AcceptanceTracker(max_k, acceptance_decay, prior_acceptance)
        self.explore_every = explore_every
        self._steps = 0
        self._last_used = [-1] * (max_k + 1)  # step at which each k was last chosen
        self.history: list[int] = []  # every k chosen (benchmarks plot it)

    @classmethod
    def from_config(cls, config: "SpeculatorConfig", cost_model: Optional[CostModel] = None) -> "DynamicK":
        d = config.dynamic
        return cls(config.num_speculative_tokens, cost_model, d.acceptance_decay, d.prior_acceptance, d.explore_every)

    def costs(self, num_rows: int) -> Optional[list[float]]:
        """t(B, k) for every k: measured, else interpolated between the nearest measured k (None until k = 0
        and k = max_k are both measured at this batch size)."""
        known = {k: c for k in range(self.max_k + 1) if (c := self.cost_model.cost(num_rows, k)) is not None}
        if 0 not in known or self.max_k not in known:
            return None
        out = []
        for k in range(self.max_k + 1):
            if k in known:
                out.append(known[k])
                continue
            lo = max(j for j in known if j < k)
            hi = min(j for j in known if j > k)
            out.append(known[lo] + (known[hi] - known[lo]) * (k - lo) / (hi - lo))
        return out

    def best_k(self, num_rows: int) -> Optional[int]:
        """argmax of expected tokens per second, or None while the costs at this batch size are unknown."""
        costs = self.costs(num_rows)
        if costs is None:
            return None
        best, best_rate = 0, self.acceptance.expected_tokens(0) / max(costs[0], 1e-12)
        for k in range(1, self.max_k + 1):
            rate = self.acceptance.expected_tokens(k) / max(costs[k], 1e-12)
            if rate > best_rate * (1 + MARGIN):
                best, best_rate = k, rate
        return best

    def choose(self, num_decode_rows: int) -> int:
        self._steps += 1
        self.acceptance.tick()
        k = self._choose(num_decode_rows)
        self._last_used[k] = self._steps
        self.history.append(k)
        return k

    def _choose(self, num_rows: int) -> int:
        if self.max_k == 0 or num_rows == 0:
            return 0
        best = self.best_k(num_rows)
        if best is None:  # measure the two ends at this batch size first
            return 0 if self.cost_model.cost(num_rows, 0) is None else self.max_k
        if self.explore_every and self._steps % self.explore_every == 0:
            others = [k for k in range(self.max_k + 1) if k != best]
            return min(others, key=lambda k: self._last_used[k])  # the k unused for longest
        return best

    def observe_acceptance(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        self.acceptance.observe(num_draft, num_accepted)

    def observe_step(self, num_rows: int, k: int, seconds: float) -> None:
        self.cost_model.observe(num_rows, k, seconds)


class DynamicKSpeculator(Speculator):
    """Registry entry `dynamic`: drafts with `speculator.dynamic.method`; the k comes from `DynamicK`.

    The policy itself runs in the scheduler (it needs each step's outputs and timings on the host); this
    class only forwards every hook to the wrapped method, which proposes however many drafts it is asked for.
    """

    name = "dynamic"

    def __init__(self, config: "SpeculatorConfig", loaded: "LoadedModel", max_num_reqs: int,
                 device: "torch.device") -> None:
        from framework.registry import SPECULATORS

        super().__init__(config, loaded, max_num_reqs, device)
        self.inner: Speculator = SPECULATORS.get(config.dynamic.method)(config, loaded, max_num_reqs, device)

    @property
    def num_kv_layers(self) -> int:
        return self.inner.num_kv_layers

    @property
    def aux_hidden_layer_ids(self) -> tuple[int, ...]:
        return self.inner.aux_hidden_layer_ids

    def bind_kv_caches(self, kv_caches: list["torch.Tensor"]) -> None:
        self.inner.bind_kv_caches(kv_caches)

    def capture_cuda_graphs(self, batch_sizes: list[int], block_size: int, max_blocks_per_req: int) -> None:
        self.inner.capture_cuda_graphs(batch_sizes, block_size, max_blocks_per_req)

    def add_request(self, req_slot: int, request: "NewRequestData") -> None:
        self.inner.add_request(req_slot, request)

    def remove_request(self, req_slot: int) -> None:
        self.inner.remove_request(req_slot)

    def apply_staged_writes(self) -> None:
        self.inner.apply_staged_writes()

    def propose(self, inputs: ProposeInputs) -> Proposal:
        return self.inner.propose(inputs)
