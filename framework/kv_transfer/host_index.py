"""The scheduler side of the host KV tier: which prefix each host slot holds, in LRU order, and the step's copies.

Host slots are named by the prefix-cache block hash of the block they hold (the same hash the device cache
publishes it under), so a request's host hit is the run of its block hashes, after its device hit, that the
index holds. Blocks come in when the device cache evicts them (`save`) and go out least recently used first
when the tier is full. A slot a load of the step being scheduled reads is pinned until the step is built, so
no save of the same step overwrites it; the worker runs a step's saves before its loads.

With an `events` recorder, every block the tier takes in or lets go is a KV-cache event with medium "CPU".

A hybrid model's recurrent-state snapshots travel with their blocks (`snapshot_capacity` host snapshot slots;
`hooks`, the model state's prefix-cache hooks): an evicted block that has a readable snapshot on the device takes
it along; a snapshot lives only as long as its block (forgetting a block frees its snapshot), and when the
snapshot slots run out the least recently used block that has one gives it up (the block stays). A hit ends at
the last block of the run whose snapshot the tier holds, and that snapshot is loaded into a device slot the hooks
reserve for the step (a hit without a snapshot, or without a spare device slot, is not used: the prefix is
recomputed, as on the device).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from framework.params.kv_events import KVEventRecorder
from framework.params.kv_transfer import BlockTransfer, BlockTransfers, KVTierStats, SnapshotTransfer
from framework.params.prefix_cache import BlockHash, PrefixCacheHooks

MEDIUM = "CPU"  # the tier's medium in KV-cache events


class HostBlockIndex:
    """`capacity` host slots; block hash -> slot, least recently used first (and `snapshot_capacity` snapshot
    slots, by block hash, for a model whose `hooks` take snapshots)."""

    def __init__(
        self,
        capacity: int,
        block_size: int,
        snapshot_capacity: int = 0,
        hooks: Optional[PrefixCacheHooks] = None,
    ) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.hooks = hooks or PrefixCacheHooks()
        self.snapshot_capacity = snapshot_capacity if self.hooks.takes_snapshots else 0
        if self.hooks.takes_snapshots and self.snapshot_capacity < 1:
            raise ValueError("a host tier for a model that takes snapshots needs at least one snapshot slot")
        self.stats = KVTierStats(capacity_blocks=capacity, capacity_snapshots=self.snapshot_capacity)
        self._snap_of: dict[BlockHash, int] = {}  # block hash -> its snapshot's host slot
        self._snap_free: list[int] = list(range(self.snapshot_capacity - 1, -1, -1))
        self._snap_pinned: set[int] = set()
        self._snap_saves: list[SnapshotTransfer] = []
        self._snap_loads: list[SnapshotTransfer] = []
        self._reserved: Optional[int] = None  # the device snapshot slot the last `num_hits` reserved
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first
        self._pinned: set[int] = set()
        self._saves: list[BlockTransfer] = []
        self._loads: list[BlockTransfer] = []
        self._last_loads: dict[int, BlockTransfer] = {}  # device block -> its load, of the last built step
        self.events: Optional[KVEventRecorder] = None  # set to publish the tier's stores and removals

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of

    def num_hits(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, the tier holds (with snapshots: up to the last of them whose
        snapshot it holds, and a device slot reserved to load it into). Their slots are pinned until the step is
        built: the evictions of the allocation that follows (saves) must not take them."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._slot_of:
                break
            count += 1
        if self.snapshot_capacity:
            count = next((n for n in range(count, 0, -1) if hashes[n - 1] in self._snap_of), 0)
            self._reserved = self.hooks.reserve_load_slot() if count else None
            if self._reserved is None:
                return 0
            self._snap_pinned.add(self._snap_of[hashes[count - 1]])
        self._pinned.update(self._slot_of[h] for h in hashes[:count])
        return count

    def load(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Load the held blocks `hashes` into device blocks `block_ids` this step (they become most recent). A
        block no longer held gets slot -1: the worker fails that load and the scheduler recomputes it."""
        for block_id, block_hash in zip(block_ids, hashes):
            slot = self._slot_of.get(block_hash, -1)
            if slot >= 0:
                self._slot_of.move_to_end(block_hash)
                self._pinned.add(slot)
            self._loads.append(BlockTransfer(block_id, slot, block_hash))
        self.stats.hit_tokens += len(block_ids) * self.block_size
        if self.snapshot_capacity and block_ids:
            self._load_snapshot(block_ids[-1], hashes[len(block_ids) - 1])

    def _load_snapshot(self, block_id: int, block_hash: BlockHash) -> None:
        """Load the snapshot that ends block `block_hash` into the device slot `num_hits` reserved; a snapshot no
        longer held gets slot -1 (the worker fails it, and the block with it)."""
        device, self._reserved = self._reserved, None
        if device is None:
            raise RuntimeError("host KV tier: a snapshot load without a device slot reserved by num_hits")
        slot = self._snap_of.get(block_hash, -1)
        if slot >= 0:
            self._snap_pinned.add(slot)
            self.stats.snapshot_hits += 1
        self.hooks.loaded_into(block_id, device)
        self._snap_loads.append(SnapshotTransfer(device, slot, block_hash, block_id))

    def save(self, block_id: int, block_hash: BlockHash) -> None:
        """Keep evicted device block `block_id` (prefix `block_hash`): into a free slot, else the least recently
        used unpinned one; skipped if the tier holds it already (it becomes most recent) or every slot is pinned."""
        device = self.hooks.snapshot_slot(block_id) if self.snapshot_capacity else None
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
        else:
            slot = self._free.pop() if self._free else self._evict_lru()
            if slot is None:
                return
            self._slot_of[block_hash] = slot
            self._saves.append(BlockTransfer(block_id, slot, block_hash))
            if self.events is not None:
                self.events.tier_stored(block_hash, MEDIUM)
        if device is not None and block_hash not in self._snap_of:
            self._save_snapshot(block_id, block_hash, device)

    def _save_snapshot(self, block_id: int, block_hash: BlockHash, device: int) -> None:
        """Keep the snapshot in device slot `device` with its block: into a free snapshot slot, else the one of the
        least recently used block that has an unpinned one (that block stays, without it)."""
        if self._snap_free:
            slot: Optional[int] = self._snap_free.pop()
        else:
            held, pinned = self._snap_of, self._snap_pinned
            victim = next((h for h in self._slot_of if h in held and held[h] not in pinned), None)
            slot = None if victim is None else self._snap_of.pop(victim)
        if slot is not None:
            self._snap_of[block_hash] = slot
            self._snap_saves.append(SnapshotTransfer(device, slot, block_hash, block_id))

    def _evict_lru(self) -> Optional[int]:
        for block_hash, slot in self._slot_of.items():
            if slot not in self._pinned:
                self._forget(block_hash)
                return slot
        return None

    def take_step(self) -> Optional[BlockTransfers]:
        """The step's copies (None if none); unpins the step's slots."""
        self._pinned.clear()
        self._snap_pinned.clear()
        self._reserved = None
        self.stats.blocks_held, self.stats.snapshots_held = len(self._slot_of), len(self._snap_of)
        if not (self._saves or self._loads or self._snap_saves):
            self._last_loads = {}
            return None
        step = BlockTransfers(tuple(self._saves), tuple(self._loads), tuple(self._snap_saves), tuple(self._snap_loads))
        self._last_loads = {t.block_id: t for t in self._loads}
        self._saves, self._loads, self._snap_saves, self._snap_loads = [], [], [], []
        return step

    def loads_failed(self, block_ids: Sequence[int]) -> None:
        """The last built step's loads into `block_ids` failed: forget their host blocks (counted)."""
        for block_id in block_ids:
            transfer = self._last_loads.get(block_id)
            if transfer is not None and self._slot_of.get(transfer.block_hash) == transfer.tier_slot:
                self._forget(transfer.block_hash)
                self._free.append(transfer.tier_slot)
            self.stats.failed_loads += 1
        self.stats.blocks_held = len(self._slot_of)

    def reset(self) -> None:
        """Forget every held block (the slots' bytes stay until overwritten)."""
        self._free.extend(self._slot_of.values())
        for block_hash in list(self._slot_of):
            self._forget(block_hash)
        self.stats.blocks_held = 0

    def _forget(self, block_hash: BlockHash) -> None:
        del self._slot_of[block_hash]
        snapshot = self._snap_of.pop(block_hash, None)
        if snapshot is not None:
            self._snap_free.append(snapshot)
        if self.events is not None:
            self.events.removed(block_hash, MEDIUM)

    def check(self) -> None:
        """Raise `AssertionError` unless every slot is either free or holds exactly one block."""
        held = list(self._slot_of.values())
        if len(held) + len(self._free) != self.capacity or len(set(held) | set(self._free)) != self.capacity:
            raise AssertionError(
                f"host KV tier: {len(held)} held + {len(self._free)} free slots != capacity {self.capacity} "
                "(or a slot is both, or twice)"
            )
        snaps = sorted([*self._snap_of.values(), *self._snap_free])
        if snaps != list(range(self.snapshot_capacity)) or not self._snap_of.keys() <= self._slot_of.keys():
            raise AssertionError(
                f"host KV tier: snapshot slots {snaps} for capacity {self.snapshot_capacity}, or a snapshot "
                "kept without its block"
            )
