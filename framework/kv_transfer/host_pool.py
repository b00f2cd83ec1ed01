"""The worker side of the host KV tier: the host copy of KV blocks, and the copies in and out of the device cache.

The pool is host memory of bytes, `[capacity, num_layers, layer_block_bytes]` (pinned on a GPU), allocated in
chunks of at most `CHUNK_BYTES` (PyTorch's pinned-memory allocator rounds each allocation up to a power of two,
so one large pool could pin up to twice its size): host slot `s` holds one block of every registered paged layer,
so a block moves in one host copy. KV caches of any
element type (FP8 included) move as their bytes. Every copy runs on the side stream, saves before loads, and
the pool remembers which prefix hash each slot was last written with: a load whose slot holds another hash (or
none) fails, and the scheduler recomputes instead.

A hybrid model's state snapshots travel beside the blocks (`HostSnapshotPool`, `bind_snapshots`): their copies
run in the same batches, saves before loads, and a snapshot load that fails fails its block's load.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from framework.kv_transfer.host_snapshots import HostSnapshotPool
from framework.kv_transfer.side_stream import SideStream
from framework.params.kv_transfer import BlockTransfer, BlockTransfers, KVTierStats, SnapshotTransfer
from framework.params.prefix_cache import BlockHash

CHUNK_BYTES = 2**30


class HostBlockPool:
    """`capacity` host slots of KV blocks and the side stream that fills and reads them."""

    def __init__(self, capacity: int, device: torch.device, stream: SideStream) -> None:
        self.capacity = capacity
        self.device = device
        self.stream = stream
        self.stats = KVTierStats(capacity_blocks=capacity)
        self.slot_hash: list[Optional[BlockHash]] = [None] * capacity  # what each slot was last written with
        self._caches: list[torch.Tensor] = []  # each layer's cache viewed as bytes, block dim first
        self._chunks: list[torch.Tensor] = []  # [slots_per_chunk, L, B] each; slot s in chunk s // slots_per_chunk
        self.slots_per_chunk = 1
        self.block_bytes = 0
        self.snapshots: Optional[HostSnapshotPool] = None  # a hybrid model's state snapshots, once bound

    def bind(self, kv_caches: Sequence[torch.Tensor], block_dim: int) -> None:
        """Allocate the pool for these cache tensors (blocks along `block_dim`)."""
        self._caches = [cache.view(torch.uint8).movedim(block_dim, 0) for cache in kv_caches]
        layer_bytes = self._caches[0][0].numel() if self._caches else 0
        if any(c[0].numel() != layer_bytes for c in self._caches):
            raise ValueError("host KV tier: every paged layer's block must have the same size")
        self.block_bytes = layer_bytes * len(self._caches)
        self.slots_per_chunk = max(1, CHUNK_BYTES // max(self.block_bytes, 1))
        pin = self.device.type == "cuda"
        self._chunks = [
            torch.empty(
                (min(self.slots_per_chunk, self.capacity - first), len(self._caches), layer_bytes),
                dtype=torch.uint8,
                pin_memory=pin,
            )
            for first in range(0, self.capacity, self.slots_per_chunk)
        ]

    def bind_snapshots(self, snapshots: Sequence[torch.Tensor], capacity: int) -> None:
        """Allocate `capacity` host snapshot slots for these snapshot tensors (slots along dimension 0)."""
        self.snapshots = HostSnapshotPool(capacity, snapshots, self.device) if snapshots else None

    def _host(self, slot: int, length: int) -> torch.Tensor:
        """[length, L, B] host bytes of slots `slot..slot + length` (within one chunk)."""
        chunk, row = divmod(slot, self.slots_per_chunk)
        return self._chunks[chunk][row : row + length]

    def start(self, transfers: BlockTransfers) -> frozenset[int]:
        """Start the step's saves, then its loads, on the side stream; returns the device blocks whose load
        cannot run (the slot no longer holds the block's hash): those are not loaded."""
        for save in transfers.saves:
            self.slot_hash[save.tier_slot] = save.block_hash
        snap_saves, snap_loads, snap_failed = self._snapshot_transfers(transfers)
        loads = [t for t in transfers.loads if t.tier_slot >= 0 and self.slot_hash[t.tier_slot] == t.block_hash]
        failed = frozenset(t.block_id for t in transfers.loads) - {t.block_id for t in loads} | snap_failed
        if transfers.saves or snap_saves:
            self.stats.bytes_to_tier += len(transfers.saves) * self.block_bytes
            self.stream.submit(lambda: self._save(transfers.saves, snap_saves))
        if loads or snap_loads:
            self.stats.bytes_to_device += len(loads) * self.block_bytes
            self.stream.submit(lambda: self._load(loads, snap_loads), timed=True)
        return failed

    def _snapshot_transfers(
        self, transfers: BlockTransfers
    ) -> tuple[Sequence[SnapshotTransfer], list[SnapshotTransfer], frozenset[int]]:
        """(the step's snapshot saves, its snapshot loads that can run, the blocks of those that cannot)."""
        if self.snapshots is None:
            if transfers.snapshot_saves or transfers.snapshot_loads:
                raise RuntimeError("host KV tier: snapshot transfers, but no snapshot tensors were registered")
            return (), [], frozenset()
        loads, failed = self.snapshots.accept(transfers.snapshot_saves, transfers.snapshot_loads)
        self.stats.bytes_to_tier += len(transfers.snapshot_saves) * self.snapshots.snapshot_bytes
        self.stats.bytes_to_device += len(loads) * self.snapshots.snapshot_bytes
        return transfers.snapshot_saves, loads, failed

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

    def _save(self, saves: Sequence[BlockTransfer], snapshots: Sequence[SnapshotTransfer]) -> None:
        if snapshots:
            assert self.snapshots is not None
            self.snapshots.save(snapshots)
        if not saves:
            return
        blocks = self._block_ids(saves)
        staged = torch.stack([cache.index_select(0, blocks).flatten(1) for cache in self._caches], dim=1)  # [n, L, B]
        for row, slot, length in slot_runs(saves, self.slots_per_chunk):  # D2H into pinned memory: a copy per run
            self._host(slot, length).copy_(staged[row : row + length], non_blocking=True)

    def _load(self, loads: Sequence[BlockTransfer], snapshots: Sequence[SnapshotTransfer]) -> None:
        if snapshots:
            assert self.snapshots is not None
            self.snapshots.load(snapshots)
        if not loads:
            return
        shape = (len(loads), *self._chunks[0].shape[1:])
        staged = torch.empty(shape, dtype=torch.uint8, device=self.device)  # [n, L, B]
        for row, slot, length in slot_runs(loads, self.slots_per_chunk):  # H2D from pinned memory: a copy per run
            staged[row : row + length].copy_(self._host(slot, length), non_blocking=True)
        blocks = self._block_ids(loads)
        for layer, cache in enumerate(self._caches):
            cache.index_copy_(0, blocks, staged[:, layer].reshape(len(loads), *cache.shape[1:]))


def slot_runs(
    transfers: Sequence[BlockTransfer] | Sequence[SnapshotTransfer], slots_per_chunk: int
) -> list[tuple[int, int, int]]:
    """(first row, first slot, length) of each run of consecutive transfers whose slots are consecutive and in one
    chunk of `slots_per_chunk`: a run moves in one copy (fresh slots are handed out in order, so a step's saves
    are mostly one run)."""
    runs: list[tuple[int, int, int]] = []
    for row, transfer in enumerate(transfers):
        slot = transfer.tier_slot
        if (
            runs
            and runs[-1][1] + runs[-1][2] == slot
            and runs[-1][0] + runs[-1][2] == row
            and slot % slots_per_chunk != 0
        ):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, transfer.tier_slot, 1))
    return runs
