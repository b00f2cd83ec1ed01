"""Which cached KV block has a snapshot of the Mamba state, in which slot of the snapshot pool.

The host-side half of prefix caching for Mamba hybrids (`MambaHybridModelState` owns the device pool). A
snapshot of block `b` is the recurrent state (every Mamba layer's conv and SSM state) after the tokens of the
prefix that `b` caches, so a request whose cache hit ends at `b` can start from it instead of recomputing
the prefix. The index implements the KV cache manager's `PrefixCacheHooks`:

- `assign_snapshot`: the step being scheduled computes the state at the end of cached block `b`; take a free
  slot, or evict the least recently used snapshot. The slot is *pending* until the next step is scheduled:
  the forward that writes it has not run, so no hit may end at it yet, and it cannot be evicted and handed to
  another block in the same step (two writes of one slot in one forward would race).
- `usable_hit`: a hit is cut back to its last block with a readable snapshot (and that snapshot is touched).
- `on_evicted`: the block's KV is gone, so is its snapshot (a pending one's slot is freed a step later).
- `reserve_load_slot` / `loaded_into`: a KV tier (the host tier) loads a snapshot it kept into a slot for the
  restores of the step being scheduled only: the slot is neither readable by later steps' hits nor handed out
  in that step, and it never is one that a restore of that step reads (the load runs before the restores). A
  reservation taken from a readable snapshot that no load used (the request was not admitted) gives the slot
  back to that snapshot in the next step.

Snapshots are not reference counted: a request copies its snapshot into its own slot when it starts, so
nothing holds a snapshot afterwards.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from framework.params.prefix_cache import BlockHash, PrefixCacheHooks


class MambaSnapshotIndex(PrefixCacheHooks):
    """Maps cached KV blocks to snapshot slots `0 .. num_slots-1`; least recently used snapshots go first."""

    takes_snapshots = True

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a snapshot index needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._ready: OrderedDict[int, int] = OrderedDict()  # block -> slot, readable; least recently used first
        self._pending: dict[int, int] = {}  # block -> slot, written by the step being scheduled
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._retired: list[int] = []  # slots of pending snapshots whose block was evicted: free next step
        # Slots a KV tier may load into in the step being scheduled -> the block whose readable snapshot the slot held
        # (None: it was free, or its block is gone). Free again next step, or that block's again if no load came.
        self._loading: dict[int, Optional[int]] = {}
        self._loaded: dict[int, int] = {}  # block -> its loading slot, for this step's restores
        self._read: set[int] = set()  # slots that restores of the step being scheduled may read
        self.num_evictions = 0  # snapshots dropped for lack of slots (their blocks stay cached)

    # ---- PrefixCacheHooks ------------------------------------------------------------------------------
    def on_schedule(self) -> None:
        self._ready.update(self._pending)  # written by the step scheduled before: most recently used
        self._pending.clear()
        self._free.extend(self._retired)
        self._retired.clear()
        for slot, block in self._loading.items():  # a reservation no load used: the snapshot it held is intact
            if block is not None and block not in self._ready:
                self._ready[block] = slot
                self._ready.move_to_end(block, last=False)  # least recently used, as when it was taken
                self.num_evictions -= 1
            else:
                self._free.append(slot)
        self._loading.clear()
        self._loaded.clear()
        self._read.clear()

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        slot = self._ready.pop(block_id, None)
        if slot is not None:
            self._free.append(slot)
        slot = self._pending.pop(block_id, None)
        if slot is not None:
            self._retired.append(slot)
        for slot, block in self._loading.items():
            if block == block_id:
                self._loading[slot] = None

    def usable_hit(self, block_ids: Sequence[int]) -> int:
        for n in range(len(block_ids), 0, -1):
            slot = self._ready.get(block_ids[n - 1])
            if slot is not None:
                self._ready.move_to_end(block_ids[n - 1])
                self._read.add(slot)
                return n
        return 0

    def assign_snapshot(self, block_id: int) -> Optional[int]:
        if block_id in self._ready or block_id in self._pending:
            return None  # one snapshot per block: another request computed this prefix already
        if self._free:
            slot = self._free.pop()
        elif self._ready:
            _, slot = self._ready.popitem(last=False)  # evict the least recently used snapshot
            self.num_evictions += 1
        else:
            return None  # every slot is pending in this step
        self._pending[block_id] = slot
        return slot

    def snapshot_slot(self, block_id: int) -> Optional[int]:
        slot = self._ready.get(block_id)
        return self._loaded.get(block_id) if slot is None else slot

    def reserve_load_slot(self) -> Optional[int]:
        if self._free:
            slot = self._free.pop()
            self._loading[slot] = None
            return slot
        # else the least recently used readable snapshot that no restore of this step reads (taken back next step
        # if no load comes: a request that hit the tier may not be admitted)
        block = next((b for b, slot in self._ready.items() if slot not in self._read), None)
        if block is None:
            return None
        self.num_evictions += 1
        slot = self._ready.pop(block)
        self._loading[slot] = block
        return slot

    def loaded_into(self, block_id: int, slot: int) -> None:
        if slot not in self._loading:
            raise ValueError(f"snapshot slot {slot} was not reserved for a load in this step")
        self._loaded[block_id] = slot
        self._loading[slot] = None  # the load overwrites the snapshot it held

    # ---- checks ------------------------------------------------------------------------------------------
    @property
    def num_snapshots(self) -> int:
        """Snapshots kept (readable or pending)."""
        return len(self._ready) + len(self._pending)

    def check(self, cached_blocks: set[int]) -> None:
        """Raise `AssertionError` unless every slot is in exactly one place (a snapshot, free, or retiring) and
        every snapshot belongs to a block in `cached_blocks` (the KV cache's cached blocks)."""
        places = [*self._ready.values(), *self._pending.values(), *self._free, *self._retired, *self._loading]
        if sorted(places) != list(range(self.num_slots)):
            raise AssertionError(f"snapshot slots leaked or doubly used: {sorted(places)} for {self.num_slots} slots")
        orphans = (self._ready.keys() | self._pending.keys()) - cached_blocks
        if orphans:
            raise AssertionError(f"snapshots kept for blocks that are not cached: {sorted(orphans)[:8]}")
