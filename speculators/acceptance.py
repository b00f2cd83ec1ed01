"""Measured draft acceptance for dynamic-k: per draft position, for the whole batch and for each request.

a_j is the acceptance of draft position j given that positions 0..j-1 were accepted. A row verifying k
drafts then yields on average `E(k) = 1 + sum_{j=1..k} prod_{i<j} a_i` tokens.

* `AcceptanceTracker`: the batch-wide a_j, as decayed counts of accepted / attempted over every row; the
  counts decay every step, so a position that is no longer measured drifts back to the prior.
* `RequestAcceptance`: each running request's own a_j, pulled towards the batch-wide rates by
  `prior_weight` pseudo-observations. Acceptance is a property of the request (a copy-heavy request accepts
  most drafts, a creative one almost none), so a batch's expected tokens are the mean of its requests'; when
  the low-acceptance requests of a mixed batch finish, the estimate moves at once instead of decaying.

Counts are numpy arrays indexed by a row per request, so a step of B rows costs a few array operations, not
B * K Python iterations; per-request observations are folded in batches (see `RequestAcceptance`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def as_int_array(values: Sequence[int]) -> np.ndarray:
    """[n] int64 (an array as it is): observations are converted once, when they arrive, so folding a batch of
    them is array work, not Python iteration over every row of every step."""
    if isinstance(values, np.ndarray):
        return values
    return np.fromiter(values, dtype=np.int64, count=len(values))


def _attempt_counts(max_k: int, num_draft: np.ndarray, num_accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([..., max_k] attempted, [..., max_k] accepted) as 0/1 for drafts and accepted counts of any shape [...]:
    position j was attempted when the row had a draft j and drafts 0..j-1 were accepted; it was accepted when
    it was attempted and j < num_accepted (<= num_draft)."""
    j = np.arange(max_k)
    attempted = (j < np.minimum(num_draft, num_accepted + 1)[..., None]).astype(np.float64)
    accepted = (j < np.minimum(num_draft, num_accepted)[..., None]).astype(np.float64)
    return attempted, accepted


def _runs(items: list, key) -> list[list]:  # type: ignore[no-untyped-def]
    """`items` cut into runs of consecutive items with equal `key` (compared by identity first)."""
    runs: list[list] = []
    last = None
    for item in items:
        k = key(item)
        if runs and (k is last or k == last):
            runs[-1].append(item)
        else:
            runs.append([item])
            last = k
    return runs


def expected_tokens_from_rates(rates: np.ndarray) -> np.ndarray:
    """[..., K + 1] E(0..K) from [..., K] conditional acceptance rates."""
    reach = np.cumprod(rates, axis=-1)
    zero = np.zeros(rates.shape[:-1] + (1,))
    return 1.0 + np.concatenate([zero, np.cumsum(reach, axis=-1)], axis=-1)


class AcceptanceTracker:
    """Batch-wide conditional acceptance a_j as decayed counts, pulled towards `prior` by one pseudo-count.

    `tick` and `observe` only queue (host time per step matters); the counts are brought up to date, with the
    same result as decaying and adding step by step, when they are read.
    """

    def __init__(self, max_k: int, decay: float, prior: float) -> None:
        self.decay = decay
        self.prior = prior
        self.accepted = np.zeros(max_k)
        self.attempted = np.zeros(max_k)
        self._ticks = 0  # steps since the last fold
        self._pending: list[tuple[int, Sequence[int], Sequence[int]]] = []  # (tick, drafts, accepted)

    def tick(self) -> None:
        """One step passed: older observations weigh less."""
        self._ticks += 1

    def observe(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        if len(num_draft):
            self._pending.append((self._ticks, as_int_array(num_draft), as_int_array(num_accepted)))

    def fold(self) -> None:
        """Apply the queued ticks and observations to the counts."""
        n, pending = self._ticks, self._pending
        self._ticks, self._pending = 0, []
        self.accepted *= self.decay ** n
        self.attempted *= self.decay ** n
        max_k = len(self.attempted)
        for run in _runs(pending, key=lambda obs: len(obs[1])):  # steps with as many rows: stacked
            weights = np.array([self.decay ** (n - t) for t, _, _ in run])
            attempted, accepted = _attempt_counts(max_k, np.stack([d for _, d, _ in run]),
                                                  np.stack([a for _, _, a in run]))
            self.attempted += weights @ attempted.sum(axis=1)  # [m] @ [m, max_k]
            self.accepted += weights @ accepted.sum(axis=1)

    def rates(self) -> np.ndarray:
        """[max_k] the a_j."""
        self.fold()
        return (self.accepted + self.prior) / (self.attempted + 1.0)

    def expected_tokens(self, k: int) -> float:
        """E(k): expected tokens a row produces per step when verifying k drafts."""
        return float(expected_tokens_from_rates(self.rates())[k])


class RequestAcceptance:
    """Per-request decayed acceptance counts; a request's rates lean on the batch-wide ones until it has
    `prior_weight` observations of a position. A request's counts decay by `decay` per observation of it
    (folding a batch of observations at once gives the same counts as folding after each).

    Observations are queued and folded into the counts in one batch of array operations when the counts are
    read (`expected_tokens`), so a policy that decides every few steps pays for the bookkeeping once per
    decision, not once per step.
    """

    def __init__(self, max_k: int, decay: float, prior_weight: float = 2.0) -> None:
        self.max_k = max_k
        self.decay = decay
        self.prior_weight = prior_weight
        self._row: dict[str, int] = {}
        self._free: list[int] = []
        self._pending: list[tuple[Sequence[str], Sequence[int], Sequence[int]]] = []
        self.accepted = np.zeros((0, max_k))
        self.attempted = np.zeros((0, max_k))
        self._cached: Optional[tuple[tuple[str, ...], np.ndarray]] = None  # see _rows_of

    def __len__(self) -> int:
        self.fold()
        return len(self._row)

    def observe(self, request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step's verification of each listed request (each request at most once per step)."""
        if request_ids:
            self._pending.append((request_ids, as_int_array(num_draft), as_int_array(num_accepted)))

    def fold(self) -> None:
        """Add the queued observations to the counts (each observed row decays once per observation first)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        # A decoding batch is the same requests step after step: each run of m steps with the same requests is
        # stacked ([m, rows]) and added at once, with the weights that decaying after every step would give.
        for run in _runs(pending, key=lambda obs: obs[0]):
            rows = self._rows_of(run[0][0])  # each request once per step: no repeated row
            attempted, accepted = _attempt_counts(self.max_k, np.stack([obs[1] for obs in run]),
                                                  np.stack([obs[2] for obs in run]))
            m = len(run)
            weights = self.decay ** np.arange(m - 1, -1, -1.0)  # [m]: the last observation weighs 1
            self.attempted[rows] = self.attempted[rows] * self.decay ** m + np.einsum("m,mrk->rk", weights, attempted)
            self.accepted[rows] = self.accepted[rows] * self.decay ** m + np.einsum("m,mrk->rk", weights, accepted)

    def remove(self, request_id: str) -> None:
        """The request ended: its row is reused by the next new request."""
        self.fold()
        row = self._row.pop(request_id, None)
        if row is not None:
            self._cached = None  # the row may go to another request
            self.accepted[row] = 0.0
            self.attempted[row] = 0.0
            self._free.append(row)

    def expected_tokens(self, request_ids: Sequence[str], prior_rates: np.ndarray) -> np.ndarray:
        """[max_k + 1] mean E(0..K) over the listed requests (unseen ones at the prior rates)."""
        self.fold()
        if not request_ids:
            return expected_tokens_from_rates(prior_rates)
        rows = self._rows_of(request_ids)  # unseen requests get a row too: zero counts, the prior rates
        w = self.prior_weight
        rates = (self.accepted[rows] + w * prior_rates) / (self.attempted[rows] + w)
        return expected_tokens_from_rates(rates).mean(axis=0)

    def _rows_of(self, request_ids: Sequence[str]) -> np.ndarray:
        """[n] int64 rows of these requests (new ones get a row). The last answer is cached: a decoding batch
        is the same list of requests step after step, and hashing it is cheaper than n lookups."""
        key = tuple(request_ids)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
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
