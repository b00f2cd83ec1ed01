"""Recurrent-state snapshots in the host tier without an engine: the index keeps them with their blocks (LRU,
freeing, pinning, a hit ends at a held snapshot), the snapshot owner's load slots, and the pool's byte-exact copies.
"""

from __future__ import annotations

import pytest
import torch

from framework.config.base import ConfigError
from framework.kv_transfer.host_connector import host_tier_slots
from framework.kv_transfer.host_index import HostBlockIndex
from framework.kv_transfer.host_pool import HostBlockPool
from framework.kv_transfer.side_stream import DeferredSideStream
from framework.params.kv_transfer import BlockTransfer, BlockTransfers, SnapshotTransfer
from model_states.mamba_snapshots import MambaSnapshotIndex


def _h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _device_index(snapshots: dict[int, int], num_slots: int = 8) -> MambaSnapshotIndex:
    """A snapshot owner whose readable snapshots are `snapshots` (block -> slot)."""
    hooks = MambaSnapshotIndex(num_slots)
    hooks.on_schedule()
    for block in snapshots:
        hooks.assign_snapshot(block)
    hooks.on_schedule()
    assert {b: hooks.snapshot_slot(b) for b in snapshots} == snapshots
    return hooks


def test_evicted_blocks_take_their_snapshots_and_hits_end_at_one():
    hooks = _device_index({1: 0, 3: 1})
    index = HostBlockIndex(capacity=4, block_size=4, snapshot_capacity=2, hooks=hooks)
    for block in range(4):  # blocks 0..3 of one prefix; 1 and 3 have device snapshots
        index.save(block, _h(block))
    step = index.take_step()
    assert step is not None and [(t.device_slot, t.tier_slot, t.block_id) for t in step.snapshot_saves] == [
        (0, 0, 1),
        (1, 1, 3),
    ]
    assert index.stats.snapshots_held == 2
    assert index.num_hits([_h(0), _h(1), _h(2)]) == 2  # block 2 has no snapshot: the hit ends at block 1
    index.load([20, 21], [_h(0), _h(1)])
    step = index.take_step()
    assert step is not None and len(step.loads) == 2
    (load,) = step.snapshot_loads
    assert (load.tier_slot, load.block_hash, load.block_id) == (0, _h(1), 21)
    assert hooks.snapshot_slot(21) == load.device_slot  # the step's restore reads the reserved slot
    assert index.stats.snapshot_hits == 1
    assert index.num_hits([_h(0)]) == 0  # a run without a held snapshot is no hit
    index.check()


def test_snapshots_live_and_die_with_their_blocks():
    hooks = _device_index({0: 0, 1: 1, 2: 2})
    index = HostBlockIndex(capacity=2, block_size=4, snapshot_capacity=2, hooks=hooks)
    index.save(0, _h(0))
    index.save(1, _h(1))
    index.save(2, _h(2))  # evicts block 0 (LRU) and its snapshot: slot 0 is reused for block 2's
    step = index.take_step()
    assert step is not None and [t.tier_slot for t in step.snapshot_saves] == [0, 1, 0]
    index.check()
    assert _h(0) not in index and index.stats.snapshots_held == 2
    index.reset()
    index.check()
    assert index.stats.blocks_held == 0 and index.take_step() is None


def test_full_snapshot_slots_drop_the_least_recent_blocks_snapshot_but_not_a_pinned_one():
    hooks = _device_index({0: 0, 1: 1, 2: 2, 3: 3})
    index = HostBlockIndex(capacity=4, block_size=4, snapshot_capacity=2, hooks=hooks)
    index.save(0, _h(0))
    index.save(1, _h(1))
    index.take_step()
    assert index.num_hits([_h(0)]) == 1  # pins block 0's snapshot for this step
    index.save(2, _h(2))  # takes block 1's snapshot slot: block 0's is pinned
    step = index.take_step()
    assert step is not None and [(t.block_id, t.tier_slot) for t in step.snapshot_saves] == [(2, 1)]
    assert _h(1) in index and index.num_hits([_h(0), _h(1)]) == 1  # block 1 stays, without its snapshot
    index.take_step()
    index.check()


def test_no_spare_device_slot_means_no_hit():
    hooks = _device_index({0: 0}, num_slots=1)
    index = HostBlockIndex(capacity=2, block_size=4, snapshot_capacity=1, hooks=hooks)
    index.save(0, _h(0))  # the device evicts block 0: the tier reads its snapshot, then the owner drops it
    hooks.on_evicted(0, _h(0))
    index.take_step()
    hooks.on_schedule()
    assert hooks.assign_snapshot(7) == 0  # ... and pending for another block in this step
    assert index.num_hits([_h(0)]) == 0  # no device slot to load the snapshot into
    hooks.on_schedule()
    assert index.num_hits([_h(0)]) == 1  # block 7's snapshot is readable now, and nobody reads it: evicted


def test_load_slots_are_never_read_by_the_steps_restores_and_free_next_step():
    hooks = _device_index({1: 0, 2: 1}, num_slots=3)
    assert hooks.usable_hit([1]) == 1  # a restore of this step reads slot 0
    assert hooks.reserve_load_slot() == 2  # the free slot
    assert hooks.reserve_load_slot() == 1  # then the least recent readable snapshot nobody reads (block 2's)
    assert hooks.reserve_load_slot() is None  # slot 0 is read by this step's restore
    hooks.loaded_into(9, 2)
    assert hooks.snapshot_slot(9) == 2 and hooks.usable_hit([9]) == 0  # for this step's restores only
    with pytest.raises(ValueError, match="not reserved"):
        hooks.loaded_into(8, 0)
    hooks.check({1, 2})
    hooks.on_schedule()
    assert hooks.snapshot_slot(9) is None  # slot 2 is free again
    assert hooks.snapshot_slot(2) == 1 and hooks.num_evictions == 0  # no load used slot 1: block 2 has it back
    assert hooks.reserve_load_slot() == 2 and hooks.reserve_load_slot() == 1  # then block 2's, the least recent
    hooks.loaded_into(9, 1)  # overwritten: block 2's snapshot is gone for good
    hooks.on_schedule()
    assert hooks.snapshot_slot(2) is None and hooks.snapshot_slot(1) == 0
    assert {hooks.reserve_load_slot(), hooks.reserve_load_slot()} == {1, 2}  # the free ones, then block 1's
    assert hooks.reserve_load_slot() == 0
    hooks.on_evicted(1, b"")  # block 1 leaves the device before the next step: nothing to give back
    hooks.on_schedule()
    assert hooks.snapshot_slot(1) is None
    hooks.check(set())


def test_pool_moves_snapshots_byte_exact_and_fails_a_stale_slot():
    pools = [torch.randn(4, 2, 3, 5), torch.randn(4, 2, 6).to(torch.bfloat16)]  # [L, P, ...] snapshot pools
    tensors = [p.movedim(1, 0) for p in pools]
    before = [p.clone() for p in pools]
    stream = DeferredSideStream()
    pool = HostBlockPool(2, torch.device("cpu"), stream)
    pool.bind([torch.zeros(10, 2, 4)], 0)
    pool.bind_snapshots(tensors, capacity=2)
    saves = (SnapshotTransfer(0, 1, _h(5), 5),)
    loads = (SnapshotTransfer(1, 1, _h(5), 7), SnapshotTransfer(1, 0, _h(6), 8))
    kv_loads = (BlockTransfer(7, 0, _h(0)),)
    failed = pool.start(BlockTransfers(saves=(BlockTransfer(0, 0, _h(0)),), snapshot_saves=saves))
    assert not failed
    failed = pool.start(BlockTransfers(loads=kv_loads, snapshot_loads=loads))
    assert failed == {8}  # host slot 0 holds no snapshot of hash 6: its block's load fails
    assert all(torch.equal(p, b) for p, b in zip(pools, before))  # nothing ran before the wait
    stream.wait()
    for p, b in zip(pools, before):
        assert torch.equal(p[:, 1], b[:, 0]) and torch.equal(p[:, 0], b[:, 0])
    assert pool.snapshots is not None and pool.snapshots.snapshot_bytes == 4 * 3 * 5 * 4 + 4 * 6 * 2


def test_host_tier_is_split_between_blocks_and_snapshots_with_the_numbers():
    assert host_tier_slots(1.0, 2**20, 2**22, available=2**31) == (512, 128)
    assert host_tier_slots(1.0, 2**20, 0, available=2**31) == (1024, 0)
    with pytest.raises(ConfigError, match="no state snapshot of 1073741824 bytes"):
        host_tier_slots(1.0, 2**20, 2**30, available=2**31)
