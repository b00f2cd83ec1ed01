"""The host tier's index (LRU, capacity, pinning, failed loads) and its pool's copies, without an engine."""

from __future__ import annotations

import pytest
import torch

from framework.config.base import ConfigError
from framework.kv_transfer.build import block_dim
from framework.kv_transfer.host_connector import host_tier_blocks
from framework.kv_transfer.host_index import HostBlockIndex
from framework.kv_transfer.host_pool import HostBlockPool
from framework.kv_transfer.side_stream import DeferredSideStream
from framework.params.kv_transfer import BlockTransfer, BlockTransfers


def _h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_lru_capacity_and_freed_slots():
    index = HostBlockIndex(capacity=3, block_size=4)
    for block in range(5):  # five evictions into three slots: the two oldest go
        index.save(block, _h(block))
        index.check()
        assert len(index) <= 3
    step = index.take_step()
    assert step is not None and [t.tier_slot for t in step.saves] == [0, 1, 2, 0, 1]
    assert [h in index for h in map(_h, range(5))] == [False, False, True, True, True]
    index.save(9, _h(2))  # held already: no copy, it becomes most recent
    index.save(7, _h(7))  # evicts the least recent: 3, in slot 0
    step = index.take_step()
    assert step is not None and [(t.block_id, t.tier_slot) for t in step.saves] == [(7, 0)]
    assert _h(3) not in index and _h(2) in index
    assert index.take_step() is None


def test_a_hit_is_pinned_against_the_same_steps_saves():
    index = HostBlockIndex(capacity=2, block_size=4)
    index.save(0, _h(0))
    index.save(1, _h(1))
    index.take_step()
    assert index.num_hits([_h(0), _h(1), _h(5)]) == 2  # pins both slots
    index.save(2, _h(2))  # no unpinned slot: not kept
    index.load([10, 11], [_h(0), _h(1)])
    step = index.take_step()
    assert (
        step is not None and step.saves == () and [(t.block_id, t.tier_slot) for t in step.loads] == [(10, 0), (11, 1)]
    )
    assert index.stats.hit_tokens == 8
    index.save(3, _h(3))  # unpinned again: evicts the least recent (slot 0)
    assert index.take_step().saves[0].tier_slot == 0  # type: ignore[union-attr]


def test_failed_loads_free_their_slots_and_are_counted():
    index = HostBlockIndex(capacity=2, block_size=4)
    index.save(0, _h(0))
    index.take_step()
    index.num_hits([_h(0)])
    index.load([5], [_h(0)])
    index.take_step()
    index.loads_failed([5])
    assert _h(0) not in index and index.stats.failed_loads == 1
    index.check()


def _caches(num_blocks: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(2, num_blocks, 4, 2, 8).to(dtype) for _ in range(3)]  # [2, blocks, block_size, heads, dim]


@pytest.mark.parametrize("chunk_bytes", [2**30, 1], ids=["one-chunk", "slot-per-chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_pool_moves_blocks_byte_exact_after_the_wait(dtype, chunk_bytes, monkeypatch):
    monkeypatch.setattr("framework.kv_transfer.host_pool.CHUNK_BYTES", chunk_bytes)
    caches = _caches(6, dtype)
    stream = DeferredSideStream()
    pool = HostBlockPool(4, torch.device("cpu"), stream)
    pool.bind(caches, block_dim((2, 1, 4, 2, 8), (2, 2, 4, 2, 8)))
    before = [c.view(torch.uint8).clone() for c in caches]
    saves = (BlockTransfer(1, 2, _h(1)), BlockTransfer(4, 0, _h(4)), BlockTransfer(2, 1, _h(2)))
    assert not pool.start(BlockTransfers(saves=saves))
    loads = (
        BlockTransfer(5, 2, _h(1)),
        BlockTransfer(0, 0, _h(9)),
        BlockTransfer(3, 0, _h(4)),
        BlockTransfer(1, 1, _h(2)),
    )
    failed = pool.start(BlockTransfers(loads=loads))
    assert failed == {0}  # slot 0 holds block 4's hash, not 9: that load does not run
    assert torch.equal(caches[0].view(torch.uint8), before[0])  # nothing ran before the wait
    stream.wait()
    for cache, old in zip(caches, before):
        got = cache.view(torch.uint8)
        assert (
            torch.equal(got[:, 5], old[:, 1])
            and torch.equal(got[:, 3], old[:, 4])
            and torch.equal(got[:, 1], old[:, 2])
        )
        assert torch.equal(got[:, 0], old[:, 0])
    assert pool.stats.bytes_to_tier == 3 * pool.block_bytes and pool.stats.bytes_to_device == 3 * pool.block_bytes


def test_host_tier_size_checks_name_the_numbers():
    assert host_tier_blocks(1.0, 2**20, available=2**31) == 1024
    with pytest.raises(ConfigError, match=r"asks for 4.00 GiB of host memory, but only 2.00 GiB is available"):
        host_tier_blocks(4.0, 2**20, available=2**31)
    with pytest.raises(ConfigError, match="holds no KV block"):
        host_tier_blocks(1e-9, 2**20, available=2**31)


def test_slot_runs_group_consecutive_slots():
    from framework.kv_transfer.host_pool import slot_runs

    transfers = [BlockTransfer(b, s, _h(b)) for b, s in [(9, 3), (8, 4), (7, 5), (1, 0), (2, 7), (3, 8)]]
    assert slot_runs(transfers, 100) == [(0, 3, 3), (3, 0, 1), (4, 7, 2)]
    assert slot_runs(transfers, 4) == [(0, 3, 1), (1, 4, 2), (3, 0, 1), (4, 7, 1), (5, 8, 1)]  # chunks of 4 slots
