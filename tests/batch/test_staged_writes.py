"""StagedWrites (framework/batch/staged_writes.py): runs of staged values land where a plain Python loop of
element writes would put them, the last write of a position winning, for every target kind the states use."""

from __future__ import annotations

import random

import pytest
import torch

from framework.batch.staged_writes import StagedWrites


def _reference(target: torch.Tensor, writes: list[tuple[int, list, int]]) -> torch.Tensor:
    out = target.clone()
    flat = out.view(-1)
    row_len = target.shape[1] if target.dim() == 2 else 1
    for slot, values, column in writes:  # in order: a later write overwrites
        for k, v in enumerate(values):
            flat[slot * row_len + column + k] = v
    return out


def _scatter_in_reverse(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """A scatter that applies duplicates in the opposite order (a GPU scatter has no defined order)."""
    target.view(-1).index_copy_(0, index.flip(0), values.flip(0).to(target.dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.bool])
@pytest.mark.parametrize("seed", range(4))
def test_random_runs_equal_element_writes_with_the_last_one_winning(
    dtype: torch.dtype, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("framework.batch.staged_writes.scatter_reference", _scatter_in_reverse)
    rng = random.Random(seed)
    target = torch.zeros(8, 12, dtype=dtype)
    writes = []
    for _ in range(rng.randrange(1, 20)):  # overlapping runs on the same slots are likely
        column = rng.randrange(12)
        n = rng.randrange(0, 12 - column + 1)
        values = [
            rng.random() < 0.5
            if dtype == torch.bool
            else rng.uniform(-5, 5)
            if dtype.is_floating_point
            else rng.randrange(-(10**6), 10**6)
            for _ in range(n)
        ]
        writes.append((rng.randrange(8), values, column))
    staged = StagedWrites(target)
    for slot, values, column in writes:
        staged.stage(slot, values, column)
    expected = _reference(target, writes)
    staged.apply()
    assert torch.equal(target, expected)
    staged.apply()  # nothing staged: nothing changes
    assert torch.equal(target, expected)


def test_scalars_one_dimensional_targets_and_exact_large_ints() -> None:
    seeds = torch.zeros(4, dtype=torch.int64)
    staged = StagedWrites(seeds)
    staged.stage(1, 2**62 + 1)  # beyond float64's exact integers
    staged.stage(3, 7)
    staged.stage(1, 2**62 + 3)  # the slot again: the later write wins
    staged.apply()
    assert seeds.tolist() == [0, 2**62 + 3, 0, 7]
    temps = torch.ones(3)
    staged = StagedWrites(temps)
    staged.stage(0, 0.25)
    staged.stage(2, float("inf"))
    staged.apply()
    assert temps.tolist() == [0.25, 1.0, float("inf")]


def test_a_write_past_the_row_is_refused() -> None:
    staged = StagedWrites(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(IndexError, match="overflows row length 4"):
        staged.stage(0, [1, 2, 3], column=2)
    with pytest.raises(ValueError, match="1-D and 2-D"):
        StagedWrites(torch.zeros(2, 2, 2))
