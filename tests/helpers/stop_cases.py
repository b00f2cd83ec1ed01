"""A stop string completed by exactly the k-th output token of a greedy run, for the `min_tokens` boundary tests."""

from __future__ import annotations

from typing import Any


def stop_completed_by_token(tokenizer: Any, free_ids: list[int], first: int = 3) -> tuple[int, str]:
    """(k, stop): `stop` is the last two characters of the text of `free_ids[:k]`, found in no shorter prefix's
    text, and the text up to k is a prefix of the whole text (no character split across token k)."""
    whole = tokenizer.decode(free_ids)
    for k in range(first, len(free_ids) - 2):
        text, before = tokenizer.decode(free_ids[:k]), tokenizer.decode(free_ids[: k - 1])
        stop = text[-2:]
        if len(stop) == 2 and whole.startswith(text) and before != text and stop not in before:
            if whole.count(stop) == 1 and stop.strip() and "\ufffd" not in stop:
                return k, stop
    raise AssertionError(f"no usable stop string in {whole!r}")
