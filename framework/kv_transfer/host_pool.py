"""The worker side of the host KV tier: the host copy of KV blocks, and the copies in and out of the device cache.

The pool is host memory of bytes (pinned on a GPU), allocated in chunks of at most `CHUNK_BYTES` (PyTorch's
pinned-memory allocator rounds each allocation up to a power of two, so one large pool could pin up to twice its
size). A chunk is `[num_layers, slots_per_chunk, layer_block_bytes]`, layer first: host slot `s` holds one block of
every registered paged layer, and one layer of a run of consecutive slots is one contiguous copy, so loads move
layer by layer. KV caches of any element type (FP8 included) move as their bytes. The pool remembers which prefix
hash each slot was last written with: a load whose slot holds another hash (or none) fails, and the scheduler
recomputes instead.

A step's copies run on the side stream in three batches: first the saves' gathers (the blocks the device cache
evicted, into a device staging buffer, before anything overwrites them) and every snapshot copy (`state_ticket`:
the step's per-slot writes read loaded snapshots); then one part per paged layer loading that layer of every
loaded block (`layer_tickets`: the forward waits for each layer's part before it touches the layer); then the
saves' copies to host memory, off the forward's path (before the loads when a load reads a slot saved in the
same step, which the scheduler's pinning rules out: saves are never behind loads).

A hybrid model's state snapshots travel beside the blocks (`HostSnapshotPool`, `bind_snapshots`); a snapshot load
that fails fails its block's load.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from framework.kv_transfer.host_snapshots import HostSnapshotPool
from framework.kv_transfer.side_stream import SideStream, Ticket
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
        self._chunks: list[torch.Tensor] = []  # [L, slots_per_chunk, B] each; slot s in chunk s // slots_per_chunk
        self.slots_per_chunk = 1
        self.block_bytes = 0
        self.snapshots: Optional[HostSnapshotPool] = None  # a hybrid model's state snapshots, once bound
        # The last started step's tickets: its gathers and snapshot copies, and (a step that loads) each layer's load.
        self.state_ticket: Optional[Ticket] = None
        self.layer_tickets: list[Ticket] = []

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
                (len(self._caches), min(self.slots_per_chunk, self.capacity - first), layer_bytes),
                dtype=torch.uint8,
                pin_memory=pin,
            )
            for first in range(0, self.capacity, self.slots_per_chunk)
        ]

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    def bind_snapshots(self, snapshots: Sequence[torch.Tensor], capacity: int) -> None:
        """Allocate `capacity` host snapshot slots for these snapshot tensors (slots along dimension 0)."""
        self.snapshots = HostSnapshotPool(capacity, snapshots, self.device) if snapshots else None

    def _host(self, layer: int, slot: int, length: int) -> torch.Tensor:
        """[length, B] host bytes of `layer` in slots `slot..slot + length` (within one chunk): contiguous."""
        chunk, row = divmod(slot, self.slots_per_chunk)
        return self._chunks[chunk][layer, row : row + length]

    def start(self, transfers: BlockTransfers) -> frozenset[int]:
        """Start the step's copies on the side stream (module docstring: gathers and snapshots, each layer's
        loads, then the saves' host copies) and set `state_ticket` / `layer_tickets`; returns the device blocks
        whose load cannot run (the slot no longer holds the block's hash): those are not loaded."""
        for save in transfers.saves:
            self.slot_hash[save.tier_slot] = save.block_hash
        snap_saves, snap_loads, snap_failed = self._snapshot_transfers(transfers)
        loads = [t for t in transfers.loads if t.tier_slot >= 0 and self.slot_hash[t.tier_slot] == t.block_hash]
        failed = frozenset(t.block_id for t in transfers.loads) - {t.block_id for t in loads} | snap_failed
        saves = _SaveBatch(self, transfers.saves) if transfers.saves else None
        self.stats.bytes_to_tier += len(transfers.saves) * self.block_bytes
        self.stats.bytes_to_device += len(loads) * self.block_bytes
        # A load of a slot this step also saves (never, by the scheduler's pinning) must read the saved bytes.
        saved_first = saves is not None and not {t.tier_slot for t in loads}.isdisjoint(saves.slots)

        def gathers_and_snapshots() -> None:
            if self.snapshots is not None and snap_saves:
                self.snapshots.save(snap_saves)
            if saves is not None:
                saves.gather()
                if saved_first:
                    saves.to_host()
            if self.snapshots is not None and snap_loads:
                self.snapshots.load(snap_loads)

        has_state_work = saves is not None or bool(snap_saves) or bool(snap_loads)
        self.state_ticket = self.stream.submit([gathers_and_snapshots])[0] if has_state_work else None
        self.layer_tickets = []
        if loads:
            batch = _LoadBatch(self, loads)
            layers = [functools.partial(batch.load_layer, layer) for layer in range(self.num_layers)]
            self.layer_tickets = self.stream.submit(layers, timed=True)
        if saves is not None and not saved_first:
            self.stream.submit([saves.to_host])
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

    def block_ids(self, transfers: Sequence[BlockTransfer]) -> torch.Tensor:
        """[n] int64 device block ids, copied from pinned memory on a GPU (a pageable copy could wait on the host)."""
        ids = torch.tensor([t.block_id for t in transfers], dtype=torch.long, pin_memory=self.device.type == "cuda")
        return ids.to(self.device, non_blocking=True)


class _SaveBatch:
    """One step's saves, run on the side stream: `gather` copies the evicted blocks of every layer into a device
    staging buffer (before the forward may overwrite them), `to_host` copies that buffer into their host slots."""

    def __init__(self, pool: HostBlockPool, saves: Sequence[BlockTransfer]) -> None:
        self.pool = pool
        self.saves = saves
        self.slots = {t.tier_slot for t in saves}
        self._staged: Optional[torch.Tensor] = None  # [L, n, B] device bytes, between `gather` and `to_host`

    def gather(self) -> None:
        blocks = self.pool.block_ids(self.saves)
        self._staged = torch.stack([cache.index_select(0, blocks).flatten(1) for cache in self.pool._caches])

    def to_host(self) -> None:
        staged, self._staged = self._staged, None
        assert staged is not None, "host KV tier: a save's host copy before its gather"
        for row, slot, length in slot_runs(self.saves, self.pool.slots_per_chunk):  # D2H: a copy per layer and run
            for layer in range(self.pool.num_layers):
                self.pool._host(layer, slot, length).copy_(staged[layer, row : row + length], non_blocking=True)


class _LoadBatch:
    """One step's loads, one layer per side-stream part: host slots -> a device staging buffer -> the blocks."""

    def __init__(self, pool: HostBlockPool, loads: Sequence[BlockTransfer]) -> None:
        self.pool = pool
        self.loads = loads
        self.runs = slot_runs(loads, pool.slots_per_chunk)
        self._blocks: Optional[torch.Tensor] = None  # [n] int64 device block ids, copied by the first layer's part

    def load_layer(self, layer: int) -> None:
        if self._blocks is None:
            self._blocks = self.pool.block_ids(self.loads)
        cache = self.pool._caches[layer]  # [num_blocks, ...] bytes
        staged = torch.empty((len(self.loads), cache[0].numel()), dtype=torch.uint8, device=self.pool.device)
        for row, slot, length in self.runs:  # H2D from pinned memory: a copy per run
            staged[row : row + length].copy_(self.pool._host(layer, slot, length), non_blocking=True)
        cache.index_copy_(0, self._blocks, staged.view(len(self.loads), *cache.shape[1:]))


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
