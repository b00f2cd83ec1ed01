"""The host copy of a hybrid model's recurrent-state snapshots, beside the host tier's KV blocks (worker side).

A snapshot is one row (snapshot slot) of every tensor the model state's `snapshot_tensors` returns (for the
hybrid recurrent state: every recurrent layer's conv and recurrent state of one prefix). Host slot `s` holds one
snapshot as bytes, `[snapshot_bytes]`, in pinned chunks of at most `CHUNK_BYTES` on a GPU (as the KV pool). The
copies run inside the KV pool's batches on its side stream. As for blocks, the pool remembers which prefix hash
each slot was last written with, and a load whose slot holds another one fails (its block's load fails with it).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from framework.params.kv_transfer import SnapshotTransfer
from framework.params.prefix_cache import BlockHash

CHUNK_BYTES = 2**30


class HostSnapshotPool:
    """`capacity` host snapshot slots for the snapshot tensors `snapshots` (each `[P, ...]`, slot first)."""

    def __init__(self, capacity: int, snapshots: Sequence[torch.Tensor], device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self._tensors = [t.view(torch.uint8) for t in snapshots]  # [P, ...] bytes, views of the device pools
        self._widths = [t[0].numel() for t in self._tensors]
        self.snapshot_bytes = sum(self._widths)
        self.slot_hash: list[Optional[BlockHash]] = [None] * capacity  # what each slot was last written with
        self.slots_per_chunk = max(1, CHUNK_BYTES // max(self.snapshot_bytes, 1))
        pin = device.type == "cuda"
        self._chunks = [
            torch.empty(
                (min(self.slots_per_chunk, capacity - first), self.snapshot_bytes), dtype=torch.uint8, pin_memory=pin
            )
            for first in range(0, capacity, self.slots_per_chunk)
        ]

    def accept(
        self, saves: Sequence[SnapshotTransfer], loads: Sequence[SnapshotTransfer]
    ) -> tuple[list[SnapshotTransfer], frozenset[int]]:
        """Record the step's saves (their slots now hold their hashes); returns (the loads that can run, the device
        blocks of those that cannot: their slot no longer holds their hash)."""
        for save in saves:
            self.slot_hash[save.tier_slot] = save.block_hash
        ok = [t for t in loads if t.tier_slot >= 0 and self.slot_hash[t.tier_slot] == t.block_hash]
        return ok, frozenset(t.block_id for t in loads) - {t.block_id for t in ok}

    def _host(self, slot: int) -> torch.Tensor:
        chunk, row = divmod(slot, self.slots_per_chunk)
        return self._chunks[chunk][row]

    def _device_slots(self, transfers: Sequence[SnapshotTransfer]) -> torch.Tensor:
        """[n] int64 device snapshot slots (from pinned memory on a GPU)."""
        slots = [t.device_slot for t in transfers]
        pin = self.device.type == "cuda"
        return torch.tensor(slots, dtype=torch.long, pin_memory=pin).to(self.device, non_blocking=True)

    # ---- copies (on the side stream) ---------------------------------------------------------------------
    def save(self, saves: Sequence[SnapshotTransfer]) -> None:
        """Device snapshot slots -> host slots: one gather per tensor, one D2H copy per snapshot."""
        slots = self._device_slots(saves)
        staged = torch.cat([t.index_select(0, slots).reshape(len(saves), -1) for t in self._tensors], dim=1)
        for row, save in enumerate(saves):
            self._host(save.tier_slot).copy_(staged[row], non_blocking=True)

    def load(self, loads: Sequence[SnapshotTransfer]) -> None:
        """Host slots -> device snapshot slots: one H2D copy per snapshot, one scatter per tensor."""
        staged = torch.empty((len(loads), self.snapshot_bytes), dtype=torch.uint8, device=self.device)
        for row, load in enumerate(loads):
            staged[row].copy_(self._host(load.tier_slot), non_blocking=True)
        slots = self._device_slots(loads)
        for tensor, part in zip(self._tensors, staged.split(self._widths, dim=1)):
            tensor.index_copy_(0, slots, part.reshape(len(loads), *tensor.shape[1:]))
