"""Prefix caching: what identifies a full KV block, the hook for state attached to cached blocks, the counters.

A full block of `block_size` tokens is named by a chained hash: sha256 over the parent block's hash, the
block's token ids (little-endian int64) and the request's extra keys (anything else that changes the block's
KV: an encoder input, a LoRA adapter, multimodal inputs). Two requests whose first `n` blocks hold the same
tokens under the same extra keys get the same `n` hashes, whatever their later tokens, so the hash of block
`i` stands for the whole prefix up to the end of block `i`. sha256 is deterministic across processes and
collision resistant, unlike Python's `hash()`, which is salted per process and only 64 bits.

`KVCacheManager` maps these hashes to physical blocks; this module has no state of its own.
"""

from __future__ import annotations

import array
import hashlib
import sys
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union

BlockHash = bytes  # 32 bytes: sha256 digest
ExtraKey = Union[str, bytes, int]

# The parent of a request's first block. Changing the hashing scheme must change this seed, so that hashes
# of different schemes can never meet in one cache.
ROOT_HASH: BlockHash = hashlib.sha256(b"mrv2 prefix cache v1").digest()


def _key_bytes(key: ExtraKey) -> bytes:
    """A tagged, length-prefixed encoding: no two different keys (or key sequences) share bytes."""
    if isinstance(key, bool) or not isinstance(key, (str, bytes, int)):
        raise TypeError(f"prefix-cache extra keys are str, bytes or int, got {type(key).__name__}")
    if isinstance(key, int):
        tag, body = b"i", str(key).encode()
    elif isinstance(key, str):
        tag, body = b"s", key.encode("utf-8")
    else:
        tag, body = b"b", key
    return tag + len(body).to_bytes(8, "little") + body


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
    """sha256(parent || token ids as little-endian int64 || tagged extra keys)."""
    tokens = array.array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    digest = hashlib.sha256(parent)
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update(tokens.tobytes())
    for key in extra_keys:
        digest.update(_key_bytes(key))
    return digest.digest()


class HashableRequest(Protocol):
    """What hashing needs of a request (`framework.engine.request.Request` has it)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_hashes: list[BlockHash]  # hashes of its full blocks so far, extended in place
    cache_extra_keys: tuple[ExtraKey, ...]


def extend_block_hashes(request: HashableRequest, num_tokens: int, block_size: int) -> list[BlockHash]:
    """Append the hashes of the request's full blocks within its first `num_tokens` tokens (the ones not hashed
    yet) to `request.block_hashes`, and return that list. Only new blocks are hashed: O(new tokens)."""
    hashes = request.block_hashes
    num_full = num_tokens // block_size
    if len(hashes) >= num_full:
        return hashes
    for index in range(len(hashes), num_full):
        tokens = block_token_ids(request, index, block_size)
        hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, tokens, request.cache_extra_keys))
    return hashes


def block_token_ids(request: HashableRequest, index: int, block_size: int) -> Sequence[int]:
    """The token ids of the request's full block `index` (prompt, then output)."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    start, end = index * block_size, (index + 1) * block_size
    if end <= len(prompt):
        return prompt[start:end]
    # the block reaches into the output (multi-turn chats, resumed requests)
    return prompt[start:end] + output[max(start - len(prompt), 0) : end - len(prompt)]


class PrefixCacheHooks:
    """Per-block hooks for state that must travel with cached KV blocks (no-ops here).

    A ModelState with recurrent state (Mamba hybrids, `model_states.mamba_snapshots.MambaSnapshotIndex`) keeps
    a snapshot of that state at some block boundaries. The scheduler asks `assign_snapshot` for a slot when a
    request computes the state at the end of a cached block in the step being scheduled, and tells the runner
    to store it there; a snapshot is readable from the next step on (`on_schedule`). The hooks drop it when the
    block is evicted (`on_evicted`) and accept a cache hit only up to the last hit block with a readable
    snapshot (`usable_hit`), whose slot (`snapshot_slot`) the admitted request starts from.

    A KV connector's tier (the host tier) carries snapshots with the blocks the device cache evicts: it reads
    the evicted block's `snapshot_slot` (eviction observers run before `on_evicted`), and a hit of its own
    ends at a block it holds a snapshot for, loaded into a slot from `reserve_load_slot` (`loaded_into`).
    """

    takes_snapshots: bool = False  # True: the scheduler asks for snapshots (costs a little host work per step)

    def on_cached(self, block_id: int, block_hash: BlockHash) -> None:
        """Block `block_id` now holds the KV of the prefix named `block_hash` and can be shared."""

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """Block `block_id` no longer holds the prefix `block_hash` (reused for other tokens, or the cache reset)."""

    def usable_hit(self, block_ids: Sequence[int]) -> int:
        """How many of the hit blocks (a prefix of the request's blocks, in order) a request may reuse."""
        return len(block_ids)

    def on_schedule(self) -> None:
        """A new step is being scheduled: snapshots assigned while scheduling earlier steps are readable now."""

    def assign_snapshot(self, block_id: int) -> Optional[int]:
        """The step being scheduled computes the state at the end of cached block `block_id`: the snapshot slot
        to store it in, or None (no snapshot is kept for it)."""
        return None

    def snapshot_slot(self, block_id: int) -> Optional[int]:
        """The slot of the readable snapshot of block `block_id`, or None."""
        return None

    # ---- another tier of blocks (a KV connector) carries snapshots too ------------------------------------
    def reserve_load_slot(self) -> Optional[int]:
        """A KV connector will load a snapshot from its tier in the step being scheduled, before that step's
        restores: a slot for it that no restore of this step reads and no write of this step targets, free
        again from the next step on; None when no slot can be spared (the tier's hit is then not used)."""
        return None

    def loaded_into(self, block_id: int, slot: int) -> None:
        """The reserved `slot` receives the snapshot of block `block_id` (loaded from another tier) in the step
        being scheduled: `snapshot_slot(block_id)` answers it for that step's restores."""

    def check(self, cached_blocks: set[int]) -> None:
        """Raise `AssertionError` if the hooks' own bookkeeping is inconsistent (`cached_blocks`: the blocks
        published under a hash now); run with the KV cache's conservation check."""


@dataclass
class PrefixCacheStats:
    """Counters since the engine started: `queries` tokens looked up, `hits` of them served from the cache.

    A lookup happens each time a request that may read the cache is admitted: when it first runs, and when it
    resumes after a preemption (then its prompt and output so far are looked up).
    """

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0
