"""Small CPU-side updates to a persistent per-slot tensor, collected during a step and applied at once."""

from __future__ import annotations

from typing import Sequence

import torch

from framework.kernels.scatter import scatter_reference, scatter_triton


class StagedWrites:
    """Collects `(slot, column, values)` writes for one 1-D or 2-D tensor and applies them in one scatter.

    Adding a request writes its whole row here instead of touching the device tensor element by element, so
    a step costs one host-to-device copy per state tensor however many requests joined.
    """

    def __init__(self, target: torch.Tensor, device: torch.device | None = None) -> None:
        if target.dim() not in (1, 2):
            raise ValueError(f"StagedWrites supports 1-D and 2-D tensors, got shape {tuple(target.shape)}")
        self.target = target
        # Where the writes are applied: a pinned host target on a GPU is written by a kernel on the stream.
        self.device = device or target.device
        self._row_len = target.shape[1] if target.dim() == 2 else 1
        self._flat_index: list[int] = []
        self._values: list[float] = []

    def stage(self, req_slot: int, values: Sequence[float] | float, column: int = 0) -> None:
        """Write `values` into row `req_slot` starting at `column` (a scalar for 1-D targets)."""
        if not isinstance(values, (list, tuple)):
            values = [values]  # type: ignore[list-item]
        if column + len(values) > self._row_len:
            raise IndexError(f"write of {len(values)} values at column {column} overflows row length {self._row_len}")
        base = req_slot * self._row_len + column
        self._flat_index.extend(range(base, base + len(values)))
        self._values.extend(values)  # type: ignore[arg-type]

    def apply(self) -> None:
        """Scatter every staged value into the target, then forget them.

        When one position was staged more than once (a slot freed and reused before an apply, or writes left
        over from a failed step) the last write wins: a GPU scatter with duplicate indices has no defined order.
        """
        if not self._flat_index:
            return
        index = torch.tensor(self._flat_index, dtype=torch.int64)
        values = torch.tensor(self._values, dtype=self.target.dtype)
        if index.numel() > 1:
            last_first = index.flip(0)
            unique, inverse = torch.unique(last_first, return_inverse=True)
            # the first occurrence in reversed order = the last write of each position
            pos = torch.full((unique.numel(),), last_first.numel(), dtype=torch.int64)
            pos.scatter_reduce_(0, inverse, torch.arange(last_first.numel()), reduce="amin")
            keep = last_first.numel() - 1 - pos
            index, values = index[keep], values[keep]
        index = index.to(self.device, non_blocking=True)
        values = values.to(self.device, non_blocking=True)
        if self.device.type == "cuda" and not self.target.is_cuda:
            scatter_triton(self.target, index, values)
        else:
            scatter_reference(self.target, index, values)
        self._flat_index.clear()
        self._values.clear()
