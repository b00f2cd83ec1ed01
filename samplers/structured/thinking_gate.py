"""Which constrained slots are still thinking: a request with a `thinking_token_budget` is constrained in its
answer only, the output after its first end-of-thinking sequence (`thinking_end_token_ids`, `</think>`), which
the model writes itself or the budget forces. Host bookkeeping only: the grammar matchers already read every
accepted token on the host, so watching for the end sequence there costs no device work."""

from __future__ import annotations

import numpy as np

from framework.params.sampling_params import SamplingParams


class ThinkingGate:
    """Per req_slot: `thinking` (its grammar waits), the end-of-thinking ids and the last tokens seen (an end
    sequence may straddle two steps)."""

    def __init__(self, max_num_reqs: int) -> None:
        self.thinking = np.zeros(max_num_reqs, dtype=bool)
        self._end: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self._tail: list[list[int]] = [[] for _ in range(max_num_reqs)]

    def add_request(self, req_slot: int, params: SamplingParams) -> None:
        """Gate the slot when the request has a thinking budget (its end ids are resolved by then)."""
        end = list(params.thinking_end_token_ids or [])
        self.thinking[req_slot] = params.thinking_token_budget is not None and bool(end)
        self._end[req_slot] = end
        self._tail[req_slot] = []

    def answer_tokens(self, req_slot: int, tokens: list[int]) -> list[int]:
        """Of the slot's next accepted `tokens`, those of the answer (all of them once the thinking ended); the
        slot opens at the first whole end sequence."""
        if not self.thinking[req_slot]:
            return tokens
        end, seen = self._end[req_slot], self._tail[req_slot] + tokens
        m = len(end)
        for i in range(len(seen) - m + 1):
            if seen[i : i + m] == end:
                self.thinking[req_slot] = False
                self._tail[req_slot] = []
                return seen[i + m :]
        self._tail[req_slot] = seen[-(m - 1) :] if m > 1 else []
        return []
