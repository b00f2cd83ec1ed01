"""KV-cache events: what the prefix cache stored and evicted, in the message layout vLLM publishes, so that
KV-aware routers (llm-d's KV-cache indexer, NVIDIA Dynamo, SGLang's gateway) read mrv2's events unchanged.

`KVCacheManager` reports to a `KVEventRecorder` when it has one; the serving engine core takes the recorded
events after each step and publishes them as one `KVEventBatch` (`framework/entrypoints/serve/kv_events.py`).
Block hashes are the prefix cache's own sha256 chain (`framework.params.prefix_cache`): 32 bytes, the same in
every process and after a restart. The first block of a prompt has no parent (`parent_block_hash` is None); the
chain's root seed is `ROOT_HASH`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import msgspec

DEFAULT_MEDIUM = "GPU"  # where the engine's KV blocks live; a host tier reports its own medium


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamp (seconds since the epoch) and the events of one engine step, in order."""

    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None  # set only with several data-parallel ranks


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change of the prefix cache (tagged with its class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one request published under their chained hashes: `token_ids` holds
    `len(block_hashes) * block_size` tokens; `parent_block_hash` names the block before the first (None: the
    first block of a prompt)."""

    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    """Blocks no longer cached under these hashes (evicted for other tokens)."""

    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    """Every cached block is forgotten (the cache was reset, or the engine started)."""


class KVEventBatch(EventBatch):
    """The published message: msgpack of this struct (decoding accepts only these three event types)."""

    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventRecorder:
    """Collects the prefix cache's events between two `take` calls (one engine step)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []

    def stored(
        self,
        block_hashes: Sequence[bytes],
        parent: Optional[bytes],
        token_ids: Sequence[int],
        lora_id: Optional[int] = None,
        medium: str = DEFAULT_MEDIUM,
    ) -> None:
        """Blocks just published; consecutive blocks of one request extend the previous event."""
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and last.block_hashes
            and last.block_hashes[-1] == parent
            and (last.lora_id, last.medium) == (lora_id, medium)
        ):
            last.block_hashes.extend(block_hashes)
            last.token_ids.extend(token_ids)
            return
        self._events.append(BlockStored(list(block_hashes), parent, list(token_ids), self.block_size, lora_id, medium))

    def tier_stored(self, block_hash: bytes, medium: str) -> None:
        """A block another tier (`medium`, e.g. "CPU") now holds, named by its hash alone: its tokens and parent
        went out with its device `BlockStored` (vLLM's offloading tier does the same); consecutive ones share one
        event."""
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.medium == medium and not last.token_ids:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockStored([block_hash], None, [], self.block_size, None, medium))

    def removed(self, block_hash: bytes, medium: str = DEFAULT_MEDIUM) -> None:
        """A block no longer cached; consecutive removals share one event."""
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        """Everything is forgotten: earlier events of this step no longer matter."""
        self._events = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events
