"""Per-layer waits of the host KV tier, without an engine: a step's loads run one paged layer per side-stream part,
and waiting for layer i brings in layer i and nothing after it (the CPU side stream runs a part only when the
step's stream waits for it, as a GPU's forward would read a layer whose copies had not run).

The engine-level claims (a forward never reads a layer before its load, outputs equal without the tier, planted
skipped waits caught) are in tests/engine/test_host_tier_layer_waits.py.
"""

from __future__ import annotations

import torch

from framework.config.schema import CacheConfig
from framework.kv_transfer.host_connector import HostKVConnector
from framework.kv_transfer.interface import KVConnectorContext, NoKVConnector
from framework.kv_transfer.side_stream import DeferredSideStream
from framework.layers.attention import NO_KV_WAITS, AttentionMetadata
from framework.params.kv_transfer import BlockTransfer, BlockTransfers

NUM_LAYERS, NUM_BLOCKS = 4, 6


def _h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _connector(layer_waits: bool = True) -> tuple[HostKVConnector, list[torch.Tensor]]:
    caches = [torch.randn(2, NUM_BLOCKS, 4, 2, 8) for _ in range(NUM_LAYERS)]  # [2, blocks, block_size, heads, dim]
    block_bytes = sum(c[:, 0].numel() * c.element_size() for c in caches)
    cache = CacheConfig(host_kv_gib=8.5 * block_bytes / 2**30, block_size=4)  # 8 host slots
    connector = HostKVConnector(
        KVConnectorContext("worker", cache, block_bytes, torch.device("cpu"), layer_waits=layer_waits)
    )
    connector.register_kv_caches(caches, 1)
    return connector, caches


def _metadata() -> AttentionMetadata:
    zeros = torch.zeros(1, dtype=torch.int32)
    return AttentionMetadata(1, 1, zeros, zeros, zeros.view(1, 1), zeros.long(), 4, 1, 1)


def _save_then_load(connector: HostKVConnector) -> None:
    """Step 1 saves blocks 1 and 2 into host slots 0 and 1; step 2 loads them back into blocks 4 and 5."""
    saves = (BlockTransfer(1, 0, _h(1)), BlockTransfer(2, 1, _h(2)))
    connector.start_load_kv(BlockTransfers(saves=saves))
    connector.wait_for_state_loads()
    connector.start_load_kv(BlockTransfers(loads=(BlockTransfer(4, 0, _h(1)), BlockTransfer(5, 1, _h(2)))))
    connector.wait_for_state_loads()


def _loaded(caches: list[torch.Tensor], before: list[torch.Tensor]) -> list[bool]:
    """Per layer: blocks 4 and 5 hold what blocks 1 and 2 held before."""
    return [torch.equal(c[:, 4:6], b[:, 1:3]) for c, b in zip(caches, before)]


def test_loads_become_visible_layer_by_layer():
    connector, caches = _connector()
    before = [c.clone() for c in caches]
    _save_then_load(connector)
    assert _loaded(caches, before) == [False] * NUM_LAYERS  # nothing loaded before the forward's first wait
    meta = connector.bind_layer_waits(_metadata())
    for layer in range(NUM_LAYERS):
        meta.kv_waits.layer(layer)
        assert _loaded(caches, before) == [i <= layer for i in range(NUM_LAYERS)]
    stats = connector.stats()
    assert stats.num_loads == 1 and stats.bytes_to_device == 2 * connector._pool().block_bytes


def test_waiting_for_all_layers_loads_every_layer_and_a_step_without_loads_binds_no_waits():
    connector, caches = _connector()
    before = [c.clone() for c in caches]
    _save_then_load(connector)
    connector.bind_layer_waits(_metadata()).kv_waits.all()
    assert all(_loaded(caches, before))
    connector.start_load_kv(None)  # the next step moves nothing: its metadata carries the no-op waits
    meta = _metadata()
    assert connector.bind_layer_waits(meta) is meta and meta.kv_waits is NO_KV_WAITS


def test_saves_are_gathered_before_the_forward_and_copied_to_host_after_the_loads():
    """A step that saves block 1 (evicted) and loads into block 1 (handed to another prefix): the save reads the
    evicted KV before the load overwrites it, and its host copy runs after the step's layer loads."""
    connector, caches = _connector()
    before = [c.clone() for c in caches]
    connector.start_load_kv(BlockTransfers(saves=(BlockTransfer(3, 2, _h(3)),)))
    connector.wait_for_state_loads()
    pool = connector._pool()
    stream = pool.stream
    assert isinstance(stream, DeferredSideStream)
    step = BlockTransfers(saves=(BlockTransfer(1, 0, _h(1)),), loads=(BlockTransfer(1, 2, _h(3)),))
    connector.start_load_kv(step)
    connector.wait_for_state_loads()  # the gather of block 1 ran; nothing was loaded yet
    assert pool.state_ticket is None and not stream.has_run(pool.layer_tickets[0])
    connector.wait_for_loads()
    assert all(torch.equal(c[:, 1], b[:, 3]) for c, b in zip(caches, before))
    assert stream._queue, "the save's host copy is left for later, off the forward's path"
    connector.start_load_kv(BlockTransfers(loads=(BlockTransfer(5, 0, _h(1)),)))  # block 1's old KV comes back
    connector.wait_for_loads()
    assert all(torch.equal(c[:, 5], b[:, 1]) for c, b in zip(caches, before))


def test_a_model_without_per_layer_waits_gets_every_load_before_the_forward():
    connector, caches = _connector(layer_waits=False)
    before = [c.clone() for c in caches]
    _save_then_load(connector)  # wait_for_state_loads waits for everything
    assert all(_loaded(caches, before))
    meta = _metadata()
    assert connector.bind_layer_waits(meta) is meta


def test_the_no_op_connector_binds_no_waits():
    meta = _metadata()
    none = NoKVConnector()
    none.wait_for_state_loads()
    assert none.bind_layer_waits(meta) is meta and meta.kv_waits is NO_KV_WAITS
