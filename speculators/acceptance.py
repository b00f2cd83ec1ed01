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
B * K Python iterations.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _attempt_masks(max_k: int, num_draft: Sequence[int], num_accepted: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """([rows, max_k] attempted, [rows, max_k] accepted): position j was attempted when the row had a draft j
    and drafts 0..j-1 were accepted; it was accepted when j < num_accepted."""
    d = np.asarray(num_draft, dtype=np.int64)
    a = np.asarray(num_accepted, dtype=np.int64)
    j = np.arange(max_k)
    attempted = j[None, :] < np.minimum(d, a + 1)[:, None]
    return attempted, j[None, :] < a[:, None]


def expected_tokens_from_rates(rates: np.ndarray) -> np.ndarray:
    """[..., K + 1] E(0..K) from [..., K] conditional acceptance rates."""
    reach = np.cumprod(rates, axis=-1)
    zero = np.zeros(rates.shape[:-1] + (1,))
    return 1.0 + np.concatenate([zero, np.cumsum(reach, axis=-1)], axis=-1)


class AcceptanceTracker:
    """Batch-wide conditional acceptance a_j as decayed counts, pulled towards `prior` by one pseudo-count."""

    def __init__(self, max_k: int, decay: float, prior: float) -> None:
        self.decay = decay
        self.prior = prior
        self.accepted = np.zeros(max_k)
        self.attempted = np.zeros(max_k)

    def tick(self) -> None:
        """One step passed: older observations weigh less."""
        self.accepted *= self.decay
        self.attempted *= self.decay

    def observe(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        attempted, accepted = _attempt_masks(len(self.attempted), num_draft, num_accepted)
        self.attempted += attempted.sum(axis=0)
        self.accepted += (accepted & attempted).sum(axis=0)

    def rates(self) -> np.ndarray:
        """[max_k] the a_j."""
        return (self.accepted + self.prior) / (self.attempted + 1.0)

    def expected_tokens(self, k: int) -> float:
        """E(k): expected tokens a row produces per step when verifying k drafts."""
        return float(expected_tokens_from_rates(self.rates())[k])


class RequestAcceptance:
    """Per-request decayed acceptance counts; a request's rates lean on the batch-wide ones until it has
    `prior_weight` observations of a position. A request's counts decay by `decay` each time it is observed."""

    def __init__(self, max_k: int, decay: float, prior_weight: float = 2.0) -> None:
        self.max_k = max_k
        self.decay = decay
        self.prior_weight = prior_weight
        self._row: dict[str, int] = {}
        self._free: list[int] = []
        self.accepted = np.zeros((0, max_k))
        self.attempted = np.zeros((0, max_k))

    def __len__(self) -> int:
        return len(self._row)

    def observe(self, request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One step's verification of each listed request (each request at most once)."""
        if not request_ids:
            return
        rows = np.fromiter((self._row_of(r) for r in request_ids), dtype=np.int64, count=len(request_ids))
        attempted, accepted = _attempt_masks(self.max_k, num_draft, num_accepted)
        self.attempted[rows] = self.attempted[rows] * self.decay + attempted
        self.accepted[rows] = self.accepted[rows] * self.decay + (accepted & attempted)

    def remove(self, request_id: str) -> None:
        """The request ended: its row is reused by the next new request."""
        row = self._row.pop(request_id, None)
        if row is not None:
            self.accepted[row] = 0.0
            self.attempted[row] = 0.0
            self._free.append(row)

    def expected_tokens(self, request_ids: Sequence[str], prior_rates: np.ndarray) -> np.ndarray:
        """[max_k + 1] mean E(0..K) over the listed requests (unseen ones at the prior rates)."""
        if not request_ids:
            return expected_tokens_from_rates(prior_rates)
        known = [self._row[r] for r in request_ids if r in self._row]
        num_unknown = len(request_ids) - len(known)
        total = num_unknown * expected_tokens_from_rates(prior_rates)
        if known:
            rows = np.asarray(known, dtype=np.int64)
            w = self.prior_weight
            rates = (self.accepted[rows] + w * prior_rates) / (self.attempted[rows] + w)
            total = total + expected_tokens_from_rates(rates).sum(axis=0)
        return total / len(request_ids)

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
