"""ngram (prompt lookup) proposals: semantics on hand-made histories, Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from speculators.ngram import ngram_propose_reference, ngram_propose_triton


def _state(histories: list[list[int]], width: int = 40):
    tokens = torch.zeros(len(histories) + 1, width, dtype=torch.int32)
    total = torch.zeros(len(histories) + 1, dtype=torch.int32)
    for slot, h in enumerate(histories, start=1):  # slot 0 stays unused: rows map to slots 1..
        tokens[slot, : len(h)] = torch.tensor(h, dtype=torch.int32)
        total[slot] = len(h)
    return tokens, total


def _both(histories, k, min_n, max_n, width=40):
    tokens, total = _state(histories, width)
    idx = torch.arange(1, len(histories) + 1, dtype=torch.int32)
    want = ngram_propose_reference(idx, tokens, total, k, min_n, max_n)
    got = ngram_propose_triton(idx, tokens, total, k, min_n, max_n)
    assert torch.equal(got, want)
    return want.tolist()


def test_longest_match_wins_then_latest():
    # Suffix [7, 8, 9]: matched with n=3 at index 2..4 (followed by 1, 2), while [8, 9] alone also matches
    # later (followed by 5): the longer match wins.
    h = [0, 0, 7, 8, 9, 1, 2, 3, 8, 9, 5, 6, 7, 8, 9]
    assert _both([h], k=3, min_n=1, max_n=4) == [[1, 2, 3]]
    # Two matches of the same length: the latest one is used.
    h2 = [4, 5, 1, 4, 5, 2, 4, 5]
    assert _both([h2], k=2, min_n=2, max_n=2) == [[2, 4]]


def test_no_match_and_short_continuation_repeat_the_last_token():
    assert _both([[1, 2, 3, 4]], k=3, min_n=1, max_n=3) == [[4, 4, 4]]  # nothing repeats
    # [2, 3] matches at the start (n=2 < min_n=3): no proposal.
    assert _both([[2, 3, 9, 2, 3]], k=2, min_n=3, max_n=4) == [[3, 3]]
    # Match right before the end: only one token follows it, the rest repeat the last token.
    assert _both([[5, 6, 6]], k=3, min_n=1, max_n=2) == [[6, 6, 6]]
    assert _both([[3, 1, 2, 3]], k=4, min_n=1, max_n=3) == [[1, 2, 3, 3]]


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("min_n,max_n", [(1, 1), (2, 5), (3, 3)])
def test_triton_matches_reference_random(k, min_n, max_n):
    g = torch.Generator().manual_seed(k * 10 + min_n)
    histories = []
    for n in [1, 2, 7, 33, 300, 517]:  # a single token; shorter than max_n; several kernel blocks
        base = torch.randint(0, 5, (n,), generator=g).tolist()  # 5 symbols: plenty of matches
        histories.append(base)
    _both(histories, k, min_n, max_n, width=600)


def test_single_request_single_token_history():
    assert _both([[42]], k=2, min_n=1, max_n=2) == [[42, 42]]
