"""Measured draft acceptance for dynamic-k: per draft position, for the whole batch and for each request.

a_j is the acceptance of draft position j given that positions 0..j-1 were accepted. A row verifying k
drafts then yields on average `E(k) = 1 + sum_{j=1..k} prod_{i<j} a_i` tokens.

* `AcceptanceTracker`: the batch-wide a_j, as decayed counts of accepted / attempted over every row; the
  counts decay with every step that verified drafts.
* `RequestAcceptance`: each running request's own a_j, pulled towards the batch-wide rates by
  `prior_weight` pseudo-observations. Acceptance is a property of the request (a copy-heavy request accepts
  most drafts, a creative one almost none), so a batch's expected tokens are the mean of its requests'; when
  the low-acceptance requests of a mixed batch finish, the estimate moves at once instead of decaying.

The policy's host time is on the step path, so a step only queues its observation as it came (a list
append); `stack_runs` turns the queue into arrays when the policy next decides: each run of observations of
the same requests becomes one [observations, rows] array, counted with a few array operations (`run_counts`)
and added to both trackers (`add_runs`): the same counts as adding each observation as it came.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import numpy as np


class ObservedRun(NamedTuple):
    """Consecutive observations (steps that verified drafts) of the same requests, in the same order."""

    request_ids: Sequence[str]  # [r]
    drafts: np.ndarray  # [m, r] int64: drafts each row verified
    accepted: np.ndarray  # [m, r] int64: leading drafts accepted


class Removal(NamedTuple):
    """A request ended between two observations: its row is freed at this point of the queue."""

    request_id: str


Queued = Union[tuple[Sequence[str], Sequence[int], Sequence[int]], Removal]  # (ids, drafts, accepted) or a removal


def stack_runs(queue: Sequence[Queued]) -> list[Union[ObservedRun, Removal]]:
    """The queue in order, consecutive observations of the same requests stacked into one `ObservedRun`."""
    out: list[Union[ObservedRun, Removal]] = []
    run: list[tuple[Sequence[str], Sequence[int], Sequence[int]]] = []

    def flush() -> None:
        if run:
            out.append(ObservedRun(run[0][0], np.array([obs[1] for obs in run], dtype=np.int64).reshape(len(run), -1),
                                   np.array([obs[2] for obs in run], dtype=np.int64).reshape(len(run), -1)))
            run.clear()

    for item in queue:
        if isinstance(item, Removal):
            flush()
            out.append(item)
        elif not len(item[0]):
            continue
        else:
            if run and not (item[0] is run[0][0] or item[0] == run[0][0]):
                flush()
            run.append(item)
    flush()
    return out


def _position_counts(max_k: int, num_draft: np.ndarray, num_accepted: np.ndarray,
                     weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([r, max_k] attempted, [r, max_k] accepted): the weighted counts of [m, r] observations of r rows.

    Position j was attempted when the row had a draft j and drafts 0..j-1 were accepted
    (j < min(drafts, accepted + 1)); it was accepted when j < min(drafts, accepted). `weights` [m] weighs each
    step's observations: the counts are one matrix product per kind, [m] @ [m, r * max_k]."""
    m, r = num_draft.shape
    j = np.arange(max_k)
    attempted = np.minimum(num_draft, num_accepted + 1)[:, :, None] > j  # [m, r, max_k]
    accepted = np.minimum(num_draft, num_accepted)[:, :, None] > j
    return (weights @ attempted.reshape(m, -1)).reshape(r, max_k), (weights @ accepted.reshape(m, -1)).reshape(r, max_k)


def run_counts(run: ObservedRun, max_k: int, decay: float) -> tuple[np.ndarray, np.ndarray]:
    """([r, max_k] attempted, [r, max_k] accepted) of a run's rows, each observation weighing
    `decay ** (observations after it in the run)`: the counts decaying after every observation would give."""
    weights = decay ** np.arange(len(run.drafts) - 1, -1, -1.0)  # [m]: the last observation weighs 1
    return _position_counts(max_k, run.drafts, run.accepted, weights)


def add_runs(runs: Sequence[Union[ObservedRun, Removal]], requests: "RequestAcceptance",
             batch: "AcceptanceTracker") -> None:
    """Add `stack_runs`'s output, in order, to the per-request and the batch-wide counts. A run's counts are
    computed once: the batch-wide ones are their sum over rows (both decay once per observation)."""
    for run in runs:
        if isinstance(run, Removal):
            requests.remove(run.request_id)
            continue
        attempted, accepted = run_counts(run, requests.max_k, requests.decay)
        requests.add_counts(run.request_ids, attempted, accepted, len(run.drafts))
        batch.add_counts(attempted.sum(axis=0), accepted.sum(axis=0), len(run.drafts))


def expected_tokens_from_rates(rates: np.ndarray) -> np.ndarray:
    """[K + 1] E(0..K) from [K] conditional acceptance rates; from [r, K] rates, the mean over the r rows."""
    reach = np.cumprod(rates, axis=-1)  # [.., K]: probability that drafts 0..j are all accepted
    if reach.ndim == 2:
        reach = reach.mean(axis=0)  # E is linear in reach: the mean of the rows' E is E of the mean reach
    return np.concatenate(([1.0], 1.0 + np.cumsum(reach)))


class AcceptanceTracker:
    """Batch-wide conditional acceptance a_j as decayed counts, pulled towards `prior` by one pseudo-count.

    Counts decay by `decay` per step that verified drafts, not per step: while the policy runs at k = 0
    nothing is measured, and what was measured last stays the estimate (decaying with time would drift
    every a_j back to the prior, and an untested prior of 0.5 makes drafting look worth it again when
    acceptance is ~0). Explorations bring new observations.
    """

    def __init__(self, max_k: int, decay: float, prior: float) -> None:
        self.decay = decay
        self.prior = prior
        self.accepted = np.zeros(max_k)
        self.attempted = np.zeros(max_k)

    def add_counts(self, attempted: np.ndarray, accepted: np.ndarray, num_observations: int) -> None:
        """Add [max_k] counts made over `num_observations` steps (the earlier counts decay that many times)."""
        factor = self.decay ** num_observations
        self.attempted = self.attempted * factor + attempted
        self.accepted = self.accepted * factor + accepted

    def observe(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step's rows (each verified `num_draft` drafts and accepted `num_accepted`)."""
        run = stack_runs([(range(len(num_draft)), num_draft, num_accepted)])
        if run:
            attempted, accepted = run_counts(run[0], len(self.attempted), self.decay)  # type: ignore[arg-type]
            self.add_counts(attempted.sum(axis=0), accepted.sum(axis=0), 1)

    def rates(self) -> np.ndarray:
        """[max_k] the a_j."""
        return (self.accepted + self.prior) / (self.attempted + 1.0)

    def expected_tokens(self, k: int) -> float:
        """E(k): expected tokens a row produces per step when verifying k drafts."""
        return float(expected_tokens_from_rates(self.rates())[k])


class RequestAcceptance:
    """Per-request decayed acceptance counts; a request's rates lean on the batch-wide ones until it has
    `prior_weight` observations of a position. A request's counts decay by `decay` per observation of it.

    `add_runs` adds a queue of observations in bulk: a run of m observations of the same requests at once, with
    the weights that decaying after each would give.
    """

    def __init__(self, max_k: int, decay: float, prior_weight: float = 2.0) -> None:
        self.max_k = max_k
        self.decay = decay
        self.prior_weight = prior_weight
        self._row: dict[str, int] = {}
        self._free: list[int] = []
        self.accepted = np.zeros((0, max_k))
        self.attempted = np.zeros((0, max_k))
        self._cached: Optional[tuple[tuple[str, ...], np.ndarray]] = None  # see _rows_of

    def __len__(self) -> int:
        return len(self._row)

    def add_counts(self, request_ids: Sequence[str], attempted: np.ndarray, accepted: np.ndarray,
                   num_observations: int) -> None:
        """Add [r, max_k] counts of these requests, made over `num_observations` observations of each (their
        earlier counts decay that many times)."""
        rows = self._rows_of(request_ids)  # each request once per step: no repeated row
        factor = self.decay ** num_observations
        self.attempted[rows] = self.attempted[rows] * factor + attempted
        self.accepted[rows] = self.accepted[rows] * factor + accepted

    def observe(self, request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step's verification of each listed request (each request at most once per step)."""
        run = stack_runs([(request_ids, num_draft, num_accepted)])
        if run:
            attempted, accepted = run_counts(run[0], self.max_k, self.decay)  # type: ignore[arg-type]
            self.add_counts(request_ids, attempted, accepted, 1)

    def remove(self, request_id: str) -> None:
        """The request ended: its row is reused by the next new request."""
        row = self._row.pop(request_id, None)
        if row is not None:
            self._cached = None  # the row may go to another request
            self.accepted[row] = 0.0
            self.attempted[row] = 0.0
            self._free.append(row)

    def expected_tokens(self, request_ids: Sequence[str], prior_rates: np.ndarray) -> np.ndarray:
        """[max_k + 1] mean E(0..K) over the listed requests (unseen ones at the prior rates)."""
        if not request_ids:
            return expected_tokens_from_rates(prior_rates)
        rows = self._rows_of(request_ids)  # unseen requests get a row too: zero counts, the prior rates
        w = self.prior_weight
        rates = (self.accepted[rows] + w * prior_rates) / (self.attempted[rows] + w)
        return expected_tokens_from_rates(rates)

    def _rows_of(self, request_ids: Sequence[str]) -> np.ndarray:
        """[n] int64 rows of these requests (new ones get a row). The last answer is cached: a decoding batch
        is the same list of requests step after step, and hashing it is cheaper than n lookups."""
        key = tuple(request_ids)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        try:  # known requests: the lookups in C
            rows = np.fromiter(map(self._row.__getitem__, key), dtype=np.int64, count=len(key))
        except KeyError:
            rows = np.fromiter((self._row_of(r) for r in key), dtype=np.int64, count=len(key))
        self._cached = (key, rows)
        return rows

    def _row_of(self, request_id: str) -> int:
        row = self._row.get(request_id)
        if row is None:
            if not self._free:  # grow: double the arrays
                old = len(self.accepted)
                new = max(16, 2 * old)
                self.accepted = np.concatenate([self.accepted, np.zeros((new - old, self.max_k))])
                self.attempted = np.concatenate([self.attempted, np.zeros((new - old, self.max_k))])
                self._free.extend(range(new - 1, old - 1, -1))
            row = self._free.pop()
            self._row[request_id] = row
        return row
