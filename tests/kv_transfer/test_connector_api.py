"""The KV-connector interface's plumbing: selection by name, the no-op default, and the tier's /metrics names."""

from __future__ import annotations

import pytest
import torch

from framework.config.registry import KV_CONNECTORS, RegistryError
from framework.config.schema import CacheConfig
from framework.entrypoints.serve.metrics import _EngineCollector
from framework.entrypoints.serve.protocol import EngineStats
from framework.kv_transfer.build import block_dim, build_kv_connector, kv_connector_name
from framework.kv_transfer.interface import KVConnectorContext, NoKVConnector


def _context(**cache: object) -> KVConnectorContext:
    return KVConnectorContext("scheduler", CacheConfig(**cache), 1024, torch.device("cpu"))  # type: ignore[arg-type]


def test_selection_by_name():
    assert kv_connector_name(CacheConfig()) == "none"
    assert kv_connector_name(CacheConfig(host_kv_gib=1.0)) == "host"
    assert kv_connector_name(CacheConfig(host_kv_gib=1.0, kv_connector="mine")) == "mine"
    assert isinstance(build_kv_connector(_context()), NoKVConnector)
    assert "host" in KV_CONNECTORS.names()
    with pytest.raises(RegistryError, match="unknown KV connector 'nope'; registered: .*host"):
        build_kv_connector(_context(kv_connector="nope"))


def test_a_registered_class_that_is_no_connector_is_refused():
    KV_CONNECTORS.register("not_a_connector", dict)
    try:
        with pytest.raises(RegistryError, match="not a KVConnector subclass"):
            build_kv_connector(_context(kv_connector="not_a_connector"))
    finally:
        KV_CONNECTORS.unregister("not_a_connector")


def test_the_no_op_connector_reports_nothing():
    none = NoKVConnector()
    none.start_load_kv(None)
    none.wait_for_loads()
    assert none.build_metadata() is None and none.get_finished().is_empty
    assert none.num_external_hit_tokens(None, 0, 100) == 0  # type: ignore[arg-type]


def test_block_dim_of_the_paged_layout():
    assert block_dim((2, 1, 16, 8, 128), (2, 2, 16, 8, 128)) == 1
    with pytest.raises(ValueError, match="exactly one dimension"):
        block_dim((1, 1), (2, 2))


def test_metrics_export_the_host_tier():
    stats = EngineStats(1, 0, 10, 5, 0, 0, 0, 0, 0, 64, 1, 4096, 8192, 3, 0.25, 7, 5, 2)
    families = {f.name: f for f in _EngineCollector(lambda: stats, "m", "mrv2", lambda: [], 16).collect()}
    assert families["mrv2:kv_host_tier_hits"].samples[0].value == 64
    assert families["mrv2:kv_host_tier_failed_loads"].samples[0].value == 1
    moved = {s.labels["direction"]: s.value for s in families["mrv2:kv_host_tier_bytes"].samples}
    assert moved == {"to_host": 4096, "to_device": 8192}
    latency = {s.name: s.value for s in families["mrv2:kv_host_tier_load_seconds"].samples}
    assert latency == {"mrv2:kv_host_tier_load_seconds_count": 3, "mrv2:kv_host_tier_load_seconds_sum": 0.25}
    assert families["mrv2:kv_host_tier_blocks"].samples[0].value == 7
    assert families["mrv2:kv_host_tier_snapshot_hits"].samples[0].value == 5
    assert families["mrv2:kv_host_tier_snapshots"].samples[0].value == 2
