"""What a KV connector carries between the scheduler and the runner, and what it reports back.

A KV connector moves KV blocks between the device's paged KV cache and another tier (host memory, a remote
store). Its scheduler side decides, while a step is scheduled, which blocks to load into the device cache and
which to save out of it, and packs that into a `KVConnectorMetadata` carried in the step's `SchedulerOutput`;
its worker side reads the metadata around the forward and reports, in a `KVConnectorOutput`, which transfers
finished and which loads failed. Both are plain data: a connector subclasses `KVConnectorMetadata` with its own
fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from framework.params.prefix_cache import BlockHash

# Where a block's KV lives: the device's paged KV cache, or a host-memory tier ("CPU", the name KV-cache events
# use for it).
Medium = Literal["GPU", "CPU"]


@dataclass(frozen=True)
class KVConnectorMetadata:
    """The base of a connector's per-step instructions to its worker side (a connector adds fields)."""


@dataclass(frozen=True)
class BlockTransfer:
    """Copy one block between the device cache and another tier.

    `block_id` is a physical block of the device's KV cache (the scheduler's block id), `tier_slot` a slot of the
    other tier, `block_hash` the prefix-cache hash of the tokens whose KV the block holds (it names the block in
    both tiers, and a load checks it). `medium` is the other tier's medium.
    """

    block_id: int
    tier_slot: int
    block_hash: BlockHash
    medium: Medium = "CPU"


@dataclass(frozen=True)
class SnapshotTransfer:
    """Copy one recurrent-state snapshot (a hybrid model's state at the end of a cached block) between the device's
    snapshot pool and another tier, with its block.

    `device_slot` is a slot of the model state's snapshot pool, `tier_slot` a snapshot slot of the other tier,
    `block_hash` the prefix the snapshot ends (a load checks it) and `block_id` the device block of that prefix
    (a failed load is reported as that block's).
    """

    device_slot: int
    tier_slot: int
    block_hash: BlockHash
    block_id: int


@dataclass(frozen=True)
class BlockTransfers(KVConnectorMetadata):
    """One step's transfers, in the order the worker runs them: every save of this step comes before every load
    (a block evicted and refilled in the same step is saved before it is overwritten; the same for snapshots)."""

    saves: tuple[BlockTransfer, ...] = ()  # device -> tier, before the forward overwrites the evicted blocks
    loads: tuple[BlockTransfer, ...] = ()  # tier -> device, before the forward reads them
    snapshot_saves: tuple[SnapshotTransfer, ...] = ()  # snapshots of evicted blocks, device pool -> tier
    snapshot_loads: tuple[SnapshotTransfer, ...] = ()  # tier -> device pool, before the step's restores read them

    @property
    def is_empty(self) -> bool:
        return not (self.saves or self.loads or self.snapshot_saves or self.snapshot_loads)


@dataclass(frozen=True)
class KVConnectorOutput:
    """What the worker side reports after a step's transfers started.

    `failed_block_ids`: device blocks whose load failed (the tier no longer holds the block, or it does not match
    its hash); their KV is not valid, and the scheduler recomputes every request holding one. `finished_saving`
    and `finished_loading`: request ids whose transfers of earlier steps completed (connectors that transfer
    across steps; the host tier finishes every transfer within its step and reports none).
    """

    failed_block_ids: frozenset[int] = frozenset()
    finished_saving: frozenset[str] = frozenset()
    finished_loading: frozenset[str] = frozenset()

    @property
    def is_empty(self) -> bool:
        return not (self.failed_block_ids or self.finished_saving or self.finished_loading)


EMPTY_KV_CONNECTOR_OUTPUT = KVConnectorOutput()  # frozen: the no-op connector's report, shared


@dataclass
class KVTierStats:
    """A KV tier's counters since the engine started.

    `hit_tokens`: prompt tokens admitted requests loaded from the tier instead of computing them; `failed_loads`:
    blocks whose load failed (their tokens were recomputed); `bytes_to_tier` / `bytes_to_device`: KV bytes
    copied each way; `load_seconds` / `num_loads`: the time of the steps' load batches (device-side, from the
    first copy to the last) and how many there were. `blocks_held` / `capacity_blocks`: the tier's fill now.
    A hybrid model's state snapshots travel with their blocks: `snapshot_hits` counts the snapshots loaded back
    (each ends a tier hit), `snapshots_held` / `capacity_snapshots` the tier's snapshot slots; their bytes are in
    `bytes_to_tier` / `bytes_to_device`.
    """

    hit_tokens: int = 0
    failed_loads: int = 0
    bytes_to_tier: int = 0
    bytes_to_device: int = 0
    load_seconds: float = 0.0
    num_loads: int = 0
    blocks_held: int = 0
    capacity_blocks: int = 0
    snapshot_hits: int = 0
    snapshots_held: int = 0
    capacity_snapshots: int = 0
