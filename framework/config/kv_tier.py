"""The cache config's KV-tier keys: another home for KV blocks beside the device cache (a KV connector)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from framework.config.base import StrictModel


class KVTierFields(StrictModel):
    """`cache.host_kv_gib` and `cache.kv_connector` (CacheConfig has them)."""

    host_kv_gib: float = Field(
        0.0,
        ge=0.0,
        description="Host-memory KV tier (docs/prefix-caching.md#the-host-memory-tier): GiB of (pinned) host memory "
        "that keeps the blocks the prefix cache evicts and loads them back on a later hit (for a hybrid model, half "
        "of it keeps their recurrent-state snapshots); 0 = off.",
    )
    kv_connector: Optional[str] = Field(
        None,
        description="The KV connector (a name of the KV_CONNECTORS registry, docs/guides/write-a-kv-connector.md); "
        "null = 'host' when host_kv_gib > 0, else none.",
    )
