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
append), and `fold_queue` adds a whole queue when the policy next decides, with a fixed number of array
operations whatever the queue holds: the same counts as adding each observation as it came. The batch may
change from one observation to the next (requests finish while a batch drains; with continuous batching
they come and go every step), so the queue is not grouped by batch: the rows of all its observations are
flattened into arrays and counted per request with one weighted histogram per kind (`position_counts`).
"""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np


class Removal(NamedTuple):
    """A request ended between two observations: its counts are dropped at this point of the queue."""

    request_id: str


Queued = Union[tuple[Sequence[str], Sequence[int], Sequence[int]], Removal]  # (ids, drafts, accepted) or a removal


def position_counts(
    max_k: int, rows: np.ndarray, num_draft: np.ndarray, num_accepted: np.ndarray, weights: np.ndarray, num_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """([num_rows, max_k] attempted, [num_rows, max_k] accepted): weighted counts per position of n observed
    rows (`rows`, `num_draft`, `num_accepted`, `weights`: [n]) added up per row of the trackers.

    Position j was attempted when the row had a draft j and drafts 0..j-1 were accepted
    (j < min(drafts, accepted + 1)); it was accepted when j < min(drafts, accepted). So each observed row is one
    length L per kind: a weighted histogram over (row, L) is one `bincount`, and the count of position j is the
    histogram's sum over L > j."""

    def per_row(lengths: np.ndarray) -> np.ndarray:
        hist = np.bincount(rows * (max_k + 1) + lengths, weights, num_rows * (max_k + 1)).reshape(num_rows, -1)
        return np.cumsum(hist[:, :0:-1], axis=1)[:, ::-1]  # [R, max_k]: column j sums L = j + 1 .. max_k

    return per_row(np.minimum(num_draft, num_accepted + 1)), per_row(np.minimum(num_draft, num_accepted))


def fold_queue(
    queue: Sequence[Queued], requests: "RequestAcceptance", batch: Optional["AcceptanceTracker"] = None
) -> None:
    """Add a queue of observations (each: the requests of the rows that verified drafts, drafts verified, leading
    drafts accepted; each request at most once) and removals, in order, to the per-request counts and the
    batch-wide ones: every count decays by `requests.decay` per observation after it. A removed request's row
    is zeroed and freed after the fold (a new request with its id gets another row); its observations still
    count batch-wide."""
    rows: list[np.ndarray] = []
    drafts: list[Sequence[int]] = []
    accepted: list[Sequence[int]] = []
    removed: list[int] = []
    last_ids: Optional[Sequence[str]] = None
    last_rows = np.zeros(0, dtype=np.int64)
    for item in queue:
        if isinstance(item, Removal):
            row = requests.detach(item.request_id)
            if row is not None:
                removed.append(row)
            last_ids = None  # the id may come back as another request
        elif len(item[0]):
            ids = item[0]
            if last_ids is None or not (ids is last_ids or ids == last_ids):  # steady decode: the same ids
                last_ids, last_rows = ids, requests.rows_of(ids)
            rows.append(last_rows)
            drafts.append(item[1])
            accepted.append(item[2])
    if rows:
        _add_observations(rows, drafts, accepted, requests, batch)
    for row in removed:
        requests.free(row)


def _add_observations(
    rows: list[np.ndarray],
    drafts: list[Sequence[int]],
    accepted: list[Sequence[int]],
    requests: "RequestAcceptance",
    batch: Optional["AcceptanceTracker"],
) -> None:
    """Add m observations (rows [r_i] of the requests, drafts and accepted of each row) to both trackers."""
    m = len(rows)
    sizes = [len(r) for r in rows]
    n = sum(sizes)
    firsts = [d[0] for d in drafts]
    if all(d.count(f) == len(d) for d, f in zip(drafts, firsts)):  # every row of a step verified the same k
        flat_drafts = np.repeat(np.array(firsts, dtype=np.int64), sizes)  # (a decode step's rule): no n ints read
    else:
        flat_drafts = np.fromiter(chain.from_iterable(drafts), np.int64, n)
    weights = np.repeat(requests.decay ** np.arange(m - 1, -1, -1.0), sizes)  # [n]: the last observation weighs 1
    attempted, accepted_counts = position_counts(
        requests.max_k,
        np.concatenate(rows),
        flat_drafts,
        np.fromiter(chain.from_iterable(accepted), np.int64, n),
        weights,
        len(requests.attempted),
    )
    requests.add_counts(attempted, accepted_counts, m)
    if batch is not None:
        batch.add_counts(attempted.sum(axis=0), accepted_counts.sum(axis=0), m)


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
        factor = self.decay**num_observations
        self.attempted = self.attempted * factor + attempted
        self.accepted = self.accepted * factor + accepted

    def observe(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step's rows (each verified `num_draft` drafts and accepted `num_accepted`)."""
        if len(num_draft):
            n = len(num_draft)
            attempted, accepted = position_counts(
                len(self.attempted),
                np.zeros(n, dtype=np.int64),
                np.asarray(num_draft, dtype=np.int64),
                np.asarray(num_accepted, dtype=np.int64),
                np.ones(n),
                1,
            )
            self.add_counts(attempted[0], accepted[0], 1)

    def rates(self) -> np.ndarray:
        """[max_k] the a_j."""
        return (self.accepted + self.prior) / (self.attempted + 1.0)

    def expected_tokens(self, k: int) -> float:
        """E(k): expected tokens a row produces per step when verifying k drafts."""
        return float(expected_tokens_from_rates(self.rates())[k])


class RequestAcceptance:
    """Per-request decayed acceptance counts; a request's rates lean on the batch-wide ones until it has
    `prior_weight` observations of a position. Counts decay by `decay` per observation (a step that verified
    drafts), like the batch-wide ones; `fold_queue` adds a queue of observations in bulk.
    """

    def __init__(self, max_k: int, decay: float, prior_weight: float = 2.0) -> None:
        self.max_k = max_k
        self.decay = decay
        self.prior_weight = prior_weight
        self._row: dict[str, int] = {}
        self._free: list[int] = []
        self.accepted = np.zeros((0, max_k))
        self.attempted = np.zeros((0, max_k))
        self._cached: Optional[tuple[tuple[str, ...], np.ndarray]] = None  # see rows_of

    def __len__(self) -> int:
        return len(self._row)

    def add_counts(self, attempted: np.ndarray, accepted: np.ndarray, num_observations: int) -> None:
        """Add [R, max_k] counts, one row per row of the arrays, made over `num_observations` observations (the
        earlier counts decay that many times)."""
        factor = self.decay**num_observations
        self.attempted = self.attempted * factor + attempted
        self.accepted = self.accepted * factor + accepted

    def observe(self, request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step's verification of each listed request (each request at most once per step)."""
        fold_queue([(request_ids, num_draft, num_accepted)], self)

    def remove(self, request_id: str) -> None:
        """The request ended: its row is reused by the next new request."""
        row = self.detach(request_id)
        if row is not None:
            self.free(row)

    def detach(self, request_id: str) -> Optional[int]:
        """Forget the request's id (a new request with it gets another row); its row, returned, keeps its counts
        until `free`."""
        row = self._row.pop(request_id, None)
        if row is not None:
            self._cached = None
        return row

    def free(self, row: int) -> None:
        """Zero a detached row and let a new request take it."""
        self.accepted[row] = 0.0
        self.attempted[row] = 0.0
        self._free.append(row)

    def expected_tokens(self, request_ids: Sequence[str], prior_rates: np.ndarray) -> np.ndarray:
        """[max_k + 1] mean E(0..K) over the listed requests (unseen ones at the prior rates)."""
        if not request_ids:
            return expected_tokens_from_rates(prior_rates)
        rows = self.rows_of(request_ids)  # unseen requests get a row too: zero counts, the prior rates
        w = self.prior_weight
        rates = (self.accepted[rows] + w * prior_rates) / (self.attempted[rows] + w)
        return expected_tokens_from_rates(rates)

    def rows_of(self, request_ids: Sequence[str]) -> np.ndarray:
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
