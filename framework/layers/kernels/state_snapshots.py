"""Where the Mamba kernels store recurrent-state snapshots during a step (prefix caching of hybrid models).

A snapshot is the state of one request after a given number of its tokens, stored into a slot of a snapshot
pool instead of the request's own slot. The scheduler asks for one at every block boundary whose block it
publishes in the prefix cache, so a later request that hits the cached blocks can start from the state at the
end of its hit. Both Mamba kernels (conv and scan) take the same targets, in CSR form over batch rows:
row `r` stores snapshots `row_start[r] .. row_start[r+1]-1`, the j-th after `num_tokens[j]` of the row's
tokens (0 = the state before the step), into pool slot `pool_slot[j]`; a row's entries are in increasing
`num_tokens`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch


class SnapshotTargets(NamedTuple):
    """This step's snapshots, per batch row (CSR)."""

    row_start: torch.Tensor  # [R+1] int32: first entry of each batch row
    num_tokens: torch.Tensor  # [M] int32: tokens of the row consumed before the snapshot, 0..query_len
    pool_slot: torch.Tensor  # [M] int32: snapshot-pool slot that receives it


def build_snapshot_targets(
    batch_rows: Sequence[int], num_tokens: Sequence[int], pool_slots: Sequence[int], num_rows: int, device: torch.device
) -> SnapshotTargets:
    """The CSR targets from per-snapshot lists (grouped by batch row, rows ascending, `num_tokens` ascending
    within a row), copied to the device without waiting for it."""
    rows = np.asarray(batch_rows, dtype=np.int64)
    if rows.size and (np.any(np.diff(rows) < 0) or rows[-1] >= num_rows or rows[0] < 0):
        raise ValueError(f"snapshot rows must be sorted and in [0, {num_rows}), got {list(batch_rows)}")
    start = np.zeros(num_rows + 1, dtype=np.int32)
    np.cumsum(np.bincount(rows, minlength=num_rows), out=start[1:])

    def dev(a: object) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device, non_blocking=True)

    return SnapshotTargets(dev(start), dev(num_tokens), dev(pool_slots))


def snapshots_by_row(
    snapshots: SnapshotTargets | None, pool: torch.Tensor | None, num_rows: int
) -> list[list[tuple[int, int]]]:
    """For the PyTorch references: per batch row, its (num_tokens, pool_slot) pairs (none without snapshots)."""
    if snapshots is None:
        return [[] for _ in range(num_rows)]
    if pool is None:
        raise ValueError("snapshots need a snapshot_pool to store into")
    start, tokens, slots = (t.tolist() for t in snapshots)
    return [list(zip(tokens[start[r] : start[r + 1]], slots[start[r] : start[r + 1]])) for r in range(num_rows)]
