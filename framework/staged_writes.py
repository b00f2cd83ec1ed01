"""Small CPU-side updates to a persistent per-slot tensor, collected during a step and applied at once."""

from __future__ import annotations

from typing import Sequence

import torch


class StagedWrites:
    """Collects `(slot, column, values)` writes for one 1-D or 2-D tensor and applies them in one scatter.

    Adding a request writes its whole row here instead of touching the device tensor element by element, so
    a step costs one host-to-device copy per state tensor however many requests joined.
    """

    def __init__(self, target: torch.Tensor) -> None:
        if target.dim() not in (1, 2):
            raise ValueError(f"StagedWrites supports 1-D and 2-D tensors, got shape {tuple(target.shape)}")
        self.target = target
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
        """Scatter every staged value into the target, then forget them."""
        if not self._flat_index:
            return
        device = self.target.device
        index = torch.tensor(self._flat_index, dtype=torch.int64).to(device, non_blocking=True)
        values = torch.tensor(self._values, dtype=self.target.dtype).to(device, non_blocking=True)
        self.target.view(-1).index_copy_(0, index, values)
        self._flat_index.clear()
        self._values.clear()
