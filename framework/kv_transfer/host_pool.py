"""The worker side of the host KV tier: the host copy of KV blocks, and the copies in and out of the device cache.

The pool is one host tensor of bytes, `[capacity, num_layers, layer_block_bytes]` (pinned on a GPU): host slot
`s` holds one block of every registered paged layer, so a block moves in one host copy. KV caches of any
element type (FP8 included) move as their bytes. Every copy runs on the side stream, saves before loads, and
the pool remembers which prefix hash each slot was last written with: a load whose slot holds another hash (or
none) fails, and the scheduler recomputes instead.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from framework.kv_transfer.side_stream import SideStream
from framework.params.kv_transfer import BlockTransfer, BlockTransfers, KVTierStats
from framework.params.prefix_cache import BlockHash


class HostBlockPool:
    """`capacity` host slots of KV blocks and the side stream that fills and reads them."""

    def __init__(self, capacity: int, device: torch.device, stream: SideStream) -> None:
        self.capacity = capacity
        self.device = device
        self.stream = stream
        self.stats = KVTierStats(capacity_blocks=capacity)
        self.slot_hash: list[Optional[BlockHash]] = [None] * capacity  # what each slot was last written with
        self._caches: list[torch.Tensor] = []  # each layer's cache viewed as bytes, block dim first
        self._pool: Optional[torch.Tensor] = None

    def bind(self, kv_caches: Sequence[torch.Tensor], block_dim: int) -> None:
        """Allocate the pool for these cache tensors (blocks along `block_dim`)."""
        self._caches = [cache.view(torch.uint8).movedim(block_dim, 0) for cache in kv_caches]
        layer_bytes = self._caches[0][0].numel() if self._caches else 0
        if any(c[0].numel() != layer_bytes for c in self._caches):
            raise ValueError("host KV tier: every paged layer's block must have the same size")
        self._pool = torch.empty(
            (self.capacity, len(self._caches), layer_bytes), dtype=torch.uint8, pin_memory=self.device.type == "cuda"
        )

    @property
    def block_bytes(self) -> int:
        return 0 if self._pool is None else self._pool[0].numel()

    def start(self, transfers: BlockTransfers) -> frozenset[int]:
        """Start the step's saves, then its loads, on the side stream; returns the device blocks whose load
        cannot run (the slot no longer holds the block's hash): those are not loaded."""
        for save in transfers.saves:
            self.slot_hash[save.tier_slot] = save.block_hash
        loads = [t for t in transfers.loads if t.tier_slot >= 0 and self.slot_hash[t.tier_slot] == t.block_hash]
        failed = frozenset(t.block_id for t in transfers.loads) - {t.block_id for t in loads}
        if transfers.saves:
            self.stats.bytes_to_tier += len(transfers.saves) * self.block_bytes
            self.stream.submit(lambda: self._save(transfers.saves))
        if loads:
            self.stats.bytes_to_device += len(loads) * self.block_bytes
            self.stream.submit(lambda: self._load(loads), timed=True)
        return failed

    def collect_timings(self) -> None:
        """Add the load batches finished since the last call to the latency counters (never waits)."""
        for seconds in self.stream.finished_seconds():
            self.stats.load_seconds += seconds
            self.stats.num_loads += 1

    # ---- copies (on the side stream) ---------------------------------------------------------------------
    def _block_ids(self, transfers: Sequence[BlockTransfer]) -> torch.Tensor:
        """[n] int64 device block ids, copied from pinned memory on a GPU (a pageable copy could wait on the host)."""
        ids = torch.tensor([t.block_id for t in transfers], dtype=torch.long, pin_memory=self.device.type == "cuda")
        return ids.to(self.device, non_blocking=True)

    def _save(self, saves: Sequence[BlockTransfer]) -> None:
        assert self._pool is not None
        blocks = self._block_ids(saves)
        staged = torch.stack([cache.index_select(0, blocks).flatten(1) for cache in self._caches], dim=1)  # [n, L, B]
        for row, slot, length in slot_runs(saves):  # D2H into pinned memory: one copy per run of slots
            self._pool[slot : slot + length].copy_(staged[row : row + length], non_blocking=True)

    def _load(self, loads: Sequence[BlockTransfer]) -> None:
        assert self._pool is not None
        staged = torch.empty((len(loads), *self._pool.shape[1:]), dtype=torch.uint8, device=self.device)  # [n, L, B]
        for row, slot, length in slot_runs(loads):  # H2D from pinned memory: one copy per run of slots
            staged[row : row + length].copy_(self._pool[slot : slot + length], non_blocking=True)
        blocks = self._block_ids(loads)
        for layer, cache in enumerate(self._caches):
            cache.index_copy_(0, blocks, staged[:, layer].reshape(len(loads), *cache.shape[1:]))


def slot_runs(transfers: Sequence[BlockTransfer]) -> list[tuple[int, int, int]]:
    """(first row, first slot, length) of each run of consecutive transfers whose slots are consecutive: a run
    moves in one copy (fresh slots are handed out in order, so a step's saves are mostly one run)."""
    runs: list[tuple[int, int, int]] = []
    for row, transfer in enumerate(transfers):
        if runs and runs[-1][1] + runs[-1][2] == transfer.tier_slot and runs[-1][0] + runs[-1][2] == row:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, transfer.tier_slot, 1))
    return runs
