"""The host-memory KV tier: blocks the device prefix cache evicts are kept in (pinned) host memory and loaded
back when a later request's prefix runs past its device-cache hit.

Scheduler side: a `HostBlockIndex` (hash -> host slot, LRU). Worker side: a `HostBlockPool` (the bytes) and a side
stream, which loads a step's blocks one paged layer at a time: the forward waits for each layer's copies just
before that layer (`bind_layer_waits`), so the first layers compute while the later ones still load.
`cache.host_kv_gib` sizes the tier; a tier larger than the host memory available now is refused at start, with
the numbers. For a model whose state keeps recurrent-state snapshots (Mamba, Gated DeltaNet hybrids), half of it
holds KV blocks and half holds snapshots, which travel with their blocks (`host_index`, `host_snapshots`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import torch

from framework.config.base import ConfigError
from framework.kv_transfer.host_index import HostBlockIndex
from framework.kv_transfer.host_pool import HostBlockPool
from framework.kv_transfer.interface import ConnectorLayerWaits, KVConnector, KVConnectorContext
from framework.kv_transfer.side_stream import side_stream_for
from framework.layers.attention.metadata import AttentionMetadata
from framework.params.kv_events import KVEventRecorder
from framework.params.kv_transfer import (
    EMPTY_KV_CONNECTOR_OUTPUT,
    BlockTransfers,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTierStats,
)
from framework.params.prefix_cache import BlockHash, HashableRequest

GIB = 2**30


def available_host_bytes() -> int:
    """Host memory available to a new allocation now: `MemAvailable` of /proc/meminfo, else free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_tier_blocks(host_kv_gib: float, block_bytes: int, available: Optional[int] = None) -> int:
    """Host slots of `block_bytes` that `host_kv_gib` holds; `ConfigError` if that is more memory than the host
    has available (`available`, default: now) or less than one block."""
    return host_tier_slots(host_kv_gib, block_bytes, 0, available)[0]


def host_tier_slots(
    host_kv_gib: float, block_bytes: int, snapshot_bytes: int, available: Optional[int] = None
) -> tuple[int, int]:
    """(KV block slots, snapshot slots) that `host_kv_gib` holds: all of it for blocks when `snapshot_bytes` is 0,
    else half for blocks of `block_bytes` and half for snapshots of `snapshot_bytes`; `ConfigError` if that is
    more memory than the host has available (`available`, default: now), or less than one of each."""
    wanted = int(host_kv_gib * GIB)
    available = available_host_bytes() if available is None else available
    if wanted > available:
        raise ConfigError(
            f"cache.host_kv_gib={host_kv_gib:g} asks for {wanted / GIB:.2f} GiB of host memory, but only "
            f"{available / GIB:.2f} GiB is available; lower cache.host_kv_gib"
        )
    for_blocks = wanted // 2 if snapshot_bytes else wanted
    blocks = for_blocks // block_bytes if block_bytes else 0
    snapshots = (wanted - for_blocks) // snapshot_bytes if snapshot_bytes else 0
    if blocks < 1 or (snapshot_bytes and snapshots < 1):
        share = " (half of it: the other half keeps state snapshots)" if snapshot_bytes else ""
        raise ConfigError(
            f"cache.host_kv_gib={host_kv_gib:g} ({wanted} bytes) holds no KV block of {block_bytes} bytes{share}"
            + (f", or no state snapshot of {snapshot_bytes} bytes in the other half" if snapshot_bytes else "")
            + "; raise it or set it to 0"
        )
    return blocks, snapshots


class HostKVConnector(KVConnector):
    """The host-memory tier (`cache.kv_connector: host`, the default when `cache.host_kv_gib > 0`)."""

    name = "host"
    carries_state_snapshots = True

    def __init__(self, context: KVConnectorContext) -> None:
        super().__init__(context)
        # Only the worker side allocates; the scheduler side, built after it, would see its memory as taken.
        wanted = int(context.cache.host_kv_gib * GIB)
        available = None if context.role == "worker" else wanted
        capacity, self.snapshot_capacity = host_tier_slots(
            context.cache.host_kv_gib, context.block_bytes, context.snapshot_bytes, available
        )
        self.block_size = context.cache.block_size
        self.index = (
            HostBlockIndex(capacity, self.block_size, self.snapshot_capacity, context.snapshots)
            if context.role == "scheduler"
            else None
        )
        self.pool = (
            HostBlockPool(capacity, context.device, side_stream_for(context.device))
            if context.role == "worker"
            else None
        )
        self._failed: frozenset[int] = frozenset()
        self._layer_waits = ConnectorLayerWaits(self)  # handed to the forward in a step that loads

    def _index(self) -> HostBlockIndex:
        if self.index is None:
            raise RuntimeError("host KV tier: a scheduler-side call on the worker-side object")
        return self.index

    def _pool(self) -> HostBlockPool:
        if self.pool is None:
            raise RuntimeError("host KV tier: a worker-side call on the scheduler-side object")
        return self.pool

    # ---- scheduler side ----------------------------------------------------------------------------------
    def num_external_hit_tokens(self, request: HashableRequest, num_computed_tokens: int, max_tokens: int) -> int:
        first, end = num_computed_tokens // self.block_size, max_tokens // self.block_size
        return self._index().num_hits(request.block_hashes[first:end]) * self.block_size

    def on_blocks_allocated(
        self, request: HashableRequest, block_ids: Sequence[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        first = num_computed_tokens // self.block_size
        self._index().load(block_ids, request.block_hashes[first : first + len(block_ids)])

    def on_block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        self._index().save(block_id, block_hash)

    def build_metadata(self) -> Optional[KVConnectorMetadata]:
        return self._index().take_step()

    def update_from_output(self, output: KVConnectorOutput) -> None:
        if output.failed_block_ids:
            self._index().loads_failed(sorted(output.failed_block_ids))

    def reset(self) -> None:
        self._index().reset()

    def set_kv_events(self, recorder: Optional[KVEventRecorder]) -> None:
        self._index().events = recorder

    def stats(self) -> KVTierStats:
        if self.index is not None:
            return self.index.stats
        pool = self._pool()
        pool.collect_timings()
        return pool.stats

    # ---- worker side -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], block_dim: int) -> None:
        self._pool().bind(kv_caches, block_dim)

    def register_state_snapshots(self, snapshots: Sequence[torch.Tensor]) -> None:
        pool = self._pool()
        pool.bind_snapshots(snapshots, self.snapshot_capacity)
        if pool.snapshots is not None and pool.snapshots.snapshot_bytes != self.context.snapshot_bytes:
            raise ValueError(
                f"host KV tier: snapshots of {pool.snapshots.snapshot_bytes} bytes registered, but the tier was "
                f"sized for {self.context.snapshot_bytes}"
            )

    def start_load_kv(self, metadata: Optional[KVConnectorMetadata]) -> None:
        pool = self._pool()
        if isinstance(metadata, BlockTransfers):
            self._failed = pool.start(metadata)
        else:  # nothing moves this step: no wait is left from the last one
            pool.state_ticket, pool.layer_tickets = None, []

    def wait_for_state_loads(self) -> None:
        pool = self._pool()
        if not self.context.layer_waits:  # the model's forward does not wait per layer: everything, now
            pool.stream.wait()
            pool.state_ticket, pool.layer_tickets = None, []
        elif pool.state_ticket is not None:  # the saves' gathers and the snapshot copies
            pool.stream.wait_for(pool.state_ticket)
            pool.state_ticket = None

    def bind_layer_waits(self, metadata: AttentionMetadata) -> AttentionMetadata:
        if not self._pool().layer_tickets:
            return metadata  # no load this step: the step's per-layer waits are the no-op default
        return dataclasses.replace(metadata, kv_waits=self._layer_waits)

    def wait_for_layer_load(self, layer: int) -> None:
        pool = self._pool()
        if pool.layer_tickets:
            pool.stream.wait_for(pool.layer_tickets[layer])

    def wait_for_loads(self) -> None:
        pool = self._pool()
        if pool.layer_tickets:
            pool.stream.wait_for(pool.layer_tickets[-1])
        elif pool.state_ticket is not None:
            self.wait_for_state_loads()

    def start_save_kv(self, metadata: Optional[KVConnectorMetadata]) -> None:
        pass  # blocks are saved when the device cache evicts them, before the forward (`start_load_kv`)

    def get_finished(self) -> KVConnectorOutput:
        if not self._failed:
            return EMPTY_KV_CONNECTOR_OUTPUT
        failed, self._failed = self._failed, frozenset()
        return KVConnectorOutput(failed_block_ids=failed)
