"""The KV-connector interface: a second home for KV blocks (host memory, a remote store) beside the device cache.

A connector has two sides, built as two objects of the same class (`KVConnectorContext.role`):

- the **scheduler side** lives with the KV cache manager. While a step is scheduled it answers how many more
  tokens of an arriving request the other tier holds past the device prefix-cache hit
  (`num_external_hit_tokens`), learns which device blocks were allocated to receive them (`on_blocks_allocated`)
  and which cached blocks the device cache evicts (`on_block_evicted`), and packs the step's transfers into
  the `SchedulerOutput` (`build_metadata`). After the step's transfers started it reads the worker's report
  (`update_from_output`);
- the **worker side** lives with the model runner and the KV cache tensors (`register_kv_caches`). Around each
  forward the runner calls `start_load_kv` (start this step's transfers, off the step's stream),
  `wait_for_state_loads` (the step's stream waits for what the step's per-slot writes read, before them),
  `bind_layer_waits` (the step's attention metadata carries the connector's per-layer waits into the forward:
  each paged layer waits, through `wait_for_layer_load`, for its own blocks only, just before it touches them;
  a CUDA-graph replay, which runs every layer at once, waits first through `wait_for_loads`), `start_save_kv`
  (after the forward: save what it computed) and `get_finished` (finished and failed transfers).

A hybrid model's recurrent-state snapshots (kept by its model state at cached block boundaries) travel with
their blocks in a connector that sets `carries_state_snapshots`: the scheduler side reads an evicted block's
snapshot slot from `KVConnectorContext.snapshots` (the model state's prefix-cache hooks) and reserves a slot for
one it loads; the worker side copies the slots of the tensors `register_state_snapshots` hands it. A connector
that does not is refused at start for such a model, by name.

A load that fails never fails a request: the scheduler recomputes the tokens of every request that holds a block
whose load failed. `NoKVConnector` is the default: the same verbs, doing nothing, so the runner's step has no
branch for "no connector".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Sequence

import torch

from framework.config.schema import CacheConfig
from framework.layers.attention.metadata import AttentionMetadata, KVLayerWaits
from framework.params.kv_events import KVEventRecorder
from framework.params.kv_transfer import (
    EMPTY_KV_CONNECTOR_OUTPUT,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTierStats,
)
from framework.params.prefix_cache import BlockHash, HashableRequest, PrefixCacheHooks

Role = Literal["scheduler", "worker"]


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector is built from: its role, the cache config, the bytes of one KV block over every paged
    layer the runner registers (target and draft), and the device of the KV cache. For a model state that keeps
    recurrent-state snapshots: the bytes of one snapshot and (scheduler side) the state's prefix-cache hooks.
    `layer_waits` (worker side): the model's forward calls its per-layer waits (`Model.waits_per_kv_layer`);
    when False, `bind_layer_waits` must not be relied on and every load is waited for before the forward."""

    role: Role
    cache: CacheConfig
    block_bytes: int
    device: torch.device
    snapshot_bytes: int = 0
    snapshots: PrefixCacheHooks = field(default_factory=PrefixCacheHooks)
    layer_waits: bool = True


class KVConnector(ABC):
    """A tier of KV blocks outside the device cache, indexed by the prefix cache's block hashes.

    Subclass it, implement every verb (the scheduler-side ones are called on the scheduler-side object only, the
    worker-side ones on the worker-side one) and register the class in `framework.config.registry.KV_CONNECTORS`
    (or under the `mrv2.kv_connectors` entry-point group); `cache.kv_connector=<name>` selects it.
    """

    name: str = "?"
    carries_state_snapshots: ClassVar[bool] = False  # True: serves models whose state keeps snapshots

    def __init__(self, context: KVConnectorContext) -> None:
        self.context = context

    # ---- scheduler side ----------------------------------------------------------------------------------
    @abstractmethod
    def num_external_hit_tokens(self, request: HashableRequest, num_computed_tokens: int, max_tokens: int) -> int:
        """Tokens past the first `num_computed_tokens` (the device-cache hit, a whole number of blocks) that this
        tier can load for `request`: a whole number of blocks, ending at or before `max_tokens`. The hashes of
        the request's full blocks up to `max_tokens` are in `request.block_hashes`. The request may not be admitted
        this step: a connector may protect the blocks it counts until `build_metadata`, nothing more."""

    @abstractmethod
    def on_blocks_allocated(
        self, request: HashableRequest, block_ids: Sequence[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        """The request was admitted with `num_external_tokens` tokens from this tier after its first
        `num_computed_tokens` (the device hit): load them into the device blocks `block_ids` (in position order)
        before this step's forward."""

    @abstractmethod
    def on_block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """The device cache hands out cached block `block_id` (prefix `block_hash`) for other tokens in the step
        being scheduled: its KV is still intact until that step's forward."""

    @abstractmethod
    def build_metadata(self) -> Optional[KVConnectorMetadata]:
        """This step's instructions for the worker side (None: nothing to do); starts a new step."""

    @abstractmethod
    def update_from_output(self, output: KVConnectorOutput) -> None:
        """The worker side's report on the step just started (finished transfers, failed loads)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every block of the tier (the prefix cache was reset)."""

    @abstractmethod
    def stats(self) -> KVTierStats:
        """The tier's counters since start-up (each side fills what it knows)."""

    def set_kv_events(self, recorder: Optional[KVEventRecorder]) -> None:
        """Report the blocks this tier stores and removes to `recorder`, under the tier's medium (scheduler side;
        the KV-cache events of docs/scaling-out.md). By default a connector reports nothing."""

    # ---- worker side -------------------------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], block_dim: int) -> None:
        """The device's paged KV cache tensors (every layer, target then draft), indexed by block id along
        dimension `block_dim`."""

    def register_state_snapshots(self, snapshots: Sequence[torch.Tensor]) -> None:
        """The model state's snapshot tensors, each indexed by snapshot slot along dimension 0 (empty for a model
        without snapshots). Only a connector that sets `carries_state_snapshots` is handed any."""
        if snapshots:
            raise NotImplementedError(f"KV connector '{self.name}' does not carry recurrent-state snapshots")

    @abstractmethod
    def start_load_kv(self, metadata: Optional[KVConnectorMetadata]) -> None:
        """Start this step's transfers (before the forward and the model state's restores, which read loaded
        snapshots), off the step's stream; never waits for the device."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Make the forward's stream wait until the blocks loaded for paged layer `layer` are in place."""

    @abstractmethod
    def wait_for_loads(self) -> None:
        """Make the forward's stream wait for every transfer started this step (no host sync)."""

    def wait_for_state_loads(self) -> None:
        """Before the step's per-slot writes (which restore loaded snapshots) and its forward: make the step's
        stream wait for what they read, and for the reads of blocks the forward may overwrite (evicted blocks being
        saved). A connector that waits per layer (`bind_layer_waits`) waits here for that part only; by default
        (no per-layer waits) for every transfer, `wait_for_loads`."""
        self.wait_for_loads()

    def bind_layer_waits(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """The step's attention metadata, carrying this step's per-layer waits (`AttentionMetadata.kv_waits`:
        each paged layer calls `wait_for_layer_load` for itself); `metadata` itself when no layer needs one.
        By default `metadata`: `wait_for_state_loads` waited for everything before the forward."""
        return metadata

    @abstractmethod
    def start_save_kv(self, metadata: Optional[KVConnectorMetadata]) -> None:
        """After the forward: start saving what it computed, if this connector saves computed blocks."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers finished since the last call and this step's failed loads."""


class ConnectorLayerWaits(KVLayerWaits):
    """The per-layer waits a connector hands the forward (`bind_layer_waits`): its own wait verbs."""

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector

    def layer(self, kv_layer: int) -> None:
        self.connector.wait_for_layer_load(kv_layer)

    def all(self) -> None:
        self.connector.wait_for_loads()


class NoKVConnector(KVConnector):
    """No other tier: every verb does nothing (the default)."""

    name = "none"
    carries_state_snapshots = True  # nothing to carry

    def __init__(self, context: Optional[KVConnectorContext] = None) -> None:
        self.context = context  # type: ignore[assignment]  # needs none

    def num_external_hit_tokens(self, request: HashableRequest, num_computed_tokens: int, max_tokens: int) -> int:
        return 0

    def on_blocks_allocated(
        self, request: HashableRequest, block_ids: Sequence[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        pass

    def on_block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        pass

    def build_metadata(self) -> Optional[KVConnectorMetadata]:
        return None

    def update_from_output(self, output: KVConnectorOutput) -> None:
        pass

    def reset(self) -> None:
        pass

    def stats(self) -> KVTierStats:
        return KVTierStats()

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], block_dim: int) -> None:
        pass

    def register_state_snapshots(self, snapshots: Sequence[torch.Tensor]) -> None:
        pass

    def start_load_kv(self, metadata: Optional[KVConnectorMetadata]) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def wait_for_loads(self) -> None:
        pass

    def wait_for_state_loads(self) -> None:
        pass

    def start_save_kv(self, metadata: Optional[KVConnectorMetadata]) -> None:
        pass

    def get_finished(self) -> KVConnectorOutput:
        return EMPTY_KV_CONNECTOR_OUTPUT
