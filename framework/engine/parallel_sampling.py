"""Parallel sampling (`SamplingParams.n > 1`): one request id, n sequences.

The engine expands such a request into n child requests of one sequence each (`fan_out`) and relabels their
outputs with the parent's id and the sequence's `index` (`ParallelSamplingTable`). The children are queued
together, so with prefix caching the later ones find the prompt blocks the first one publishes when it is
scheduled and share them (a prompt is computed once). With a seed, sequence 0 samples with it (so `n=1` and
sequence 0 of `n=4` agree) and sequence i with a seed derived from (seed, i).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, TypeVar

from framework.engine.request import RequestOutput
from framework.params.sampling_params import SamplingParams

CHILD_SEPARATOR = "#"  # child id = parent id + "#" + index; parents with n == 1 keep their own id
_MASK63 = (1 << 63) - 1


def child_seed(seed: int, index: int) -> int:
    """Seed of sequence `index` of a request seeded with `seed` (splitmix64 of both; sequence 0 keeps `seed`)."""
    if index == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of sequence `index` of request `request_id` (abort it to end that sequence alone)."""
    return request_id if n == 1 else f"{request_id}{CHILD_SEPARATOR}{index}"


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(child id, child params with n=1) per sequence; a request with n == 1 is its own only child."""
    if params.n == 1:
        return [(request_id, params)]
    children = []
    for i in range(params.n):
        child = dataclasses.replace(params, n=1, seed=None if params.seed is None else child_seed(params.seed, i))
        child._bad_words_token_ids = params._bad_words_token_ids  # resolved by the engine; replace() drops it
        children.append((child_request_id(request_id, i, params.n), child))
    return children


Output = TypeVar("Output")


class ParallelSamplingTable:
    """Which child request belongs to which parent: the engine's one owner of the n > 1 bookkeeping."""

    def __init__(self) -> None:
        self._parent_of: dict[str, tuple[str, int]] = {}  # child id -> (parent id, sequence index)
        self._children: dict[str, list[str]] = {}  # parent id -> its unfinished child ids

    def __bool__(self) -> bool:
        return bool(self._children)

    def __contains__(self, parent_id: str) -> bool:
        return parent_id in self._children

    def add(self, parent_id: str, child_ids: Sequence[str]) -> None:
        """Remember a parent with n > 1 children (n == 1 requests are not recorded)."""
        if len(child_ids) > 1:
            self._children[parent_id] = list(child_ids)
            for index, child in enumerate(child_ids):
                self._parent_of[child] = (parent_id, index)

    def children(self, parent_id: str) -> list[str]:
        """The child ids still in flight of `parent_id` ([parent_id] itself for an n == 1 request)."""
        return list(self._children.get(parent_id, [parent_id]))

    def relabel(self, outputs: list[Output]) -> list[Output]:
        """Outputs of children carry their parent's id and their sequence index; finished children are forgotten."""
        if not self._parent_of:
            return outputs
        for out in outputs:
            found = self._parent_of.get(out.request_id)  # type: ignore[attr-defined]
            if found is None:
                continue
            parent, index = found
            child = out.request_id  # type: ignore[attr-defined]
            out.request_id, out.index = parent, index  # type: ignore[attr-defined]
            if out.finished:  # type: ignore[attr-defined]
                del self._parent_of[child]
                remaining = self._children[parent]
                remaining.remove(child)
                if not remaining:
                    del self._children[parent]
        return outputs


def merge_sequences(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """One `RequestOutput` for the final outputs of all sequences of a request (any order): its flat fields are
    sequence 0's, `sequences` holds every sequence in index order."""
    ordered = sorted(outputs, key=lambda o: o.index)
    if len(ordered) == 1:
        return ordered[0]
    first = ordered[0]
    return dataclasses.replace(first, sequences=[o.outputs[0] for o in ordered])


__all__ = ["CHILD_SEPARATOR", "ParallelSamplingTable", "child_request_id", "child_seed", "fan_out", "merge_sequences"]
