"""The scheduler side of the host KV tier: which prefix each host slot holds, in LRU order, and the step's copies.

Host slots are named by the prefix-cache block hash of the block they hold (the same hash the device cache
publishes it under), so a request's host hit is the run of its block hashes, after its device hit, that the
index holds. Blocks come in when the device cache evicts them (`save`) and go out least recently used first
when the tier is full. A slot a load of the step being scheduled reads is pinned until the step is built, so
no save of the same step overwrites it; the worker runs a step's saves before its loads.

With an `events` recorder, every block the tier takes in or lets go is a KV-cache event with medium "CPU".
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from framework.params.kv_events import KVEventRecorder
from framework.params.kv_transfer import BlockTransfer, BlockTransfers, KVTierStats
from framework.params.prefix_cache import BlockHash

MEDIUM = "CPU"  # the tier's medium in KV-cache events


class HostBlockIndex:
    """`capacity` host slots; block hash -> slot, least recently used first."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.stats = KVTierStats(capacity_blocks=capacity)
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
        """How many of `hashes`, from the first, the tier holds. Their slots are pinned until the step is built:
        the evictions of the allocation that follows (saves) must not take them."""
        count = 0
        for block_hash in hashes:
            slot = self._slot_of.get(block_hash)
            if slot is None:
                break
            self._pinned.add(slot)
            count += 1
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

    def save(self, block_id: int, block_hash: BlockHash) -> None:
        """Keep evicted device block `block_id` (prefix `block_hash`): into a free slot, else the least recently
        used unpinned one; skipped if the tier holds it already (it becomes most recent) or every slot is pinned."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return
        slot = self._free.pop() if self._free else self._evict_lru()
        if slot is None:
            return
        self._slot_of[block_hash] = slot
        self._saves.append(BlockTransfer(block_id, slot, block_hash))
        if self.events is not None:
            self.events.tier_stored(block_hash, MEDIUM)

    def _evict_lru(self) -> Optional[int]:
        for block_hash, slot in self._slot_of.items():
            if slot not in self._pinned:
                self._forget(block_hash)
                return slot
        return None

    def take_step(self) -> Optional[BlockTransfers]:
        """The step's copies (None if none); unpins the step's slots."""
        if not self._saves and not self._loads:
            self._last_loads = {}
            self._pinned.clear()
            return None
        step = BlockTransfers(saves=tuple(self._saves), loads=tuple(self._loads))
        self._last_loads = {t.block_id: t for t in self._loads}
        self._saves, self._loads = [], []
        self._pinned.clear()
        self.stats.blocks_held = len(self._slot_of)
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
