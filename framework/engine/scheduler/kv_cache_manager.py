"""The paged KV cache's block pool: which physical blocks each request holds, and which blocks are cached.

With prefix caching a full block whose KV is computed is *published* under its chained hash
(`framework.params.prefix_cache`); a later request whose tokens start with the same blocks takes references to them
instead of computing them again. Blocks are shared by reference count and never written while shared: a
request computes only positions past its cache hit, which starts a block of its own.

A block whose last reference goes away returns to the free queue but keeps its hash, so it can still be hit
until it is handed out again. The free queue is in eviction order: blocks that hold no cached prefix first,
then cached blocks least recently released first (a request's blocks are released last block first, so the
start of a prefix, which more requests share, stays cached longest).

With a `window` (every attention layer of the model attends through a sliding window of that many keys), a
request gives back the blocks that fell out of it (`release_out_of_window`): its list keeps `NO_BLOCK` in their
place, so positions still index it, and a prefix hit needs only the blocks the window still reads
(`find_cached_blocks`). docs/sliding-window.md#kv-memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping, Optional, Sequence

from framework.params.kv_events import KVEventRecorder
from framework.params.prefix_cache import (
    BlockHash,
    HashableRequest,
    PrefixCacheHooks,
    PrefixCacheStats,
    block_token_ids,
    extend_block_hashes,
)

# A position's entry in a request's block list once the block went back to the pool (fell out of the window); the
# runner's block table reads it as block 0 (`table_row`): no kernel reads a key there unmasked.
NO_BLOCK = -1


class KVCacheManager:
    """A free queue of KV blocks, per-block reference counts and, per request id, the blocks it holds in
    position order; with `enable_prefix_caching`, also the map from block hash to the block that caches it.

    Block ids here are indices into the physical KV cache tensors; token position `p` of a request lives in
    block `blocks[p // block_size]`, offset `p % block_size` (its *KV slot* is `block * block_size + offset`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        hooks: Optional[PrefixCacheHooks] = None,
        window: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.window = window  # every layer's sliding window (keys, the query's own included); 0: keep every block
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hooks = hooks or PrefixCacheHooks()
        self.stats = PrefixCacheStats()
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # eviction order
        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[Optional[BlockHash]] = [None] * num_blocks  # the prefix each block caches
        self._cached: dict[BlockHash, int] = {}  # hash -> the one block published under it
        self._blocks: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}  # per request: leading blocks already offered to the cache
        self._num_released: dict[str, int] = {}  # per request (window): leading blocks given back (NO_BLOCK)
        self.events: Optional[KVEventRecorder] = None  # set to publish KV-cache events (docs/scaling-out.md)
        self._eviction_observers: list[Callable[[int, BlockHash], None]] = []  # e.g. a KV tier keeping evictions

    def add_eviction_observer(self, observer: Callable[[int, BlockHash], None]) -> None:
        """Call `observer(block_id, block_hash)` whenever a cached block is handed out for other tokens; its KV (and
        its state snapshot: observers run before `hooks.on_evicted`) is intact until the forward of the step being
        scheduled (a reset of the cache calls nothing)."""
        self._eviction_observers.append(observer)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evicted when needed)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks published under a hash (held or free)."""
        return len(self._cached)

    def cached_block_hashes(self) -> set[BlockHash]:
        """The hashes of every prefix cached now (held or free)."""
        return set(self._cached)

    def growth_views(self) -> tuple[Mapping[str, list[int]], Mapping[str, int]]:
        """(blocks held per request, leading blocks offered to the cache per request), read-only: the scheduler's
        decode loop skips `allocate` / `cache_blocks` for a row that stays inside its blocks, and these answer
        that as their first lines do, without a call per row."""
        return self._blocks, self._num_published

    def blocks_of(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def table_row(self, request_id: str) -> list[int]:
        """The request's blocks as its block-table row: a released position (`NO_BLOCK`) reads block 0."""
        return [max(block, 0) for block in self._blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (released ones not counted)."""
        return len(self._blocks.get(request_id, ())) - self._num_released.get(request_id, 0)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs so that `num_tokens` positions have a KV slot."""
        have = len(self._blocks.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    # ---- prefix cache lookups ------------------------------------------------------------------------
    def find_cached_blocks(self, request: HashableRequest, num_tokens: int) -> list[int]:
        """The longest run of cached blocks the request's first `num_tokens` tokens start with (no references
        are taken: pass the result to `allocate`). Hashes the request's full blocks that are not hashed yet."""
        if not self.enable_prefix_caching:
            return []
        hashes = extend_block_hashes(request, num_tokens, self.block_size)
        if self.window:
            return window_hit([self._cached.get(h) for h in hashes[: num_tokens // self.block_size]], self)
        hit: list[int] = []
        for block_hash in hashes[: num_tokens // self.block_size]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit[: self.hooks.usable_hit(hit)] if hit else hit

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.stats.queries += num_queried
        self.stats.hits += num_hit

    # ---- allocation ----------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request to cover `num_tokens` positions; the new (uncached) block ids, or None if too few
        blocks are free. `cached_blocks` (from `find_cached_blocks`, only when the request holds no block yet)
        become its first blocks, shared."""
        held = self._blocks.get(request_id)
        if held is not None and num_tokens <= len(held) * self.block_size:
            return []  # the common decode step: the next token fits in the last block
        if cached_blocks and held:
            raise RuntimeError(f"request '{request_id}' already holds blocks: cache hits start a request")
        need = self.blocks_needed(request_id, num_tokens) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if b != NO_BLOCK and self._ref_cnt[b] == 0)  # now in the free queue
        if need + revived > len(self._free):
            return None
        for block in cached_blocks:
            if block == NO_BLOCK:  # before the window of the hit's first computed token (`window_hit`)
                self._num_released[request_id] = self._num_released.get(request_id, 0) + 1
                continue
            if self._ref_cnt[block] == 0:
                del self._free[block]
            self._ref_cnt[block] += 1
        new = self._take_free_blocks(max(need, 0))
        blocks = self._blocks.setdefault(request_id, [])
        blocks.extend(cached_blocks)
        blocks.extend(new)
        if cached_blocks:
            self._num_published[request_id] = len(cached_blocks)
        return new

    def _take_free_blocks(self, count: int) -> list[int]:
        """The next `count` blocks in eviction order, each held once; a cached one loses its hash (evicted). One
        call per allocation: a prefill chunk takes a block per position block (per KV group, with groups)."""
        pop, block_hashes, ref_cnt = self._free.popitem, self._block_hash, self._ref_cnt
        taken = []
        for _ in range(count):
            block, _ = pop(last=False)
            if block_hashes[block] is not None:
                self._evict(block)
            ref_cnt[block] = 1
            taken.append(block)
        return taken

    def _evict(self, block: int) -> None:
        """`block`, just taken from the free queue, stops caching its prefix."""
        block_hash = self._block_hash[block]
        if block_hash is not None:
            self._block_hash[block] = None
            if self._cached.get(block_hash) == block:
                del self._cached[block_hash]
                if self.events is not None:
                    self.events.removed(block_hash)
            for observer in self._eviction_observers:  # first: a tier keeping the block reads its snapshot
                observer(block, block_hash)
            self.hooks.on_evicted(block, block_hash)

    def cache_blocks(self, request: HashableRequest, num_tokens: int) -> list[tuple[int, int]]:
        """Publish the request's full blocks within its first `num_tokens` positions (their KV is computed by
        the end of the step being scheduled, and their tokens are known on the host).

        Returns, for each block of the request offered to the cache by this call, (its index in the request,
        the block that caches its prefix now): the request's own block, or an earlier copy of the same prefix.
        """
        if not self.enable_prefix_caching:
            return []
        request_id = request.request_id
        start = self._num_published.get(request_id, 0)
        if num_tokens < (start + 1) * self.block_size:
            return []  # the common decode step: no block filled
        blocks = self._blocks.get(request_id, ())
        end = min(num_tokens // self.block_size, len(blocks))
        if end <= start:
            return []
        hashes = extend_block_hashes(request, end * self.block_size, self.block_size)
        offered = []
        for index in range(start, end):
            block, block_hash = blocks[index], hashes[index]
            if block == NO_BLOCK:
                continue  # given back before it was published (a late publication under async scheduling)
            if self._block_hash[block] is None and block_hash not in self._cached:
                self._block_hash[block] = block_hash
                self._cached[block_hash] = block
                self.hooks.on_cached(block, block_hash)
                if self.events is not None:
                    parent = hashes[index - 1] if index else None
                    tokens = block_token_ids(request, index, self.block_size)
                    self.events.stored([block_hash], parent, tokens, _lora_id(request))
            # else: already cached (a hit block), or another block caches the same prefix: this one stays
            # private and returns to the pool as an uncached block.
            holder = self._cached.get(block_hash)
            if holder is not None:
                offered.append((index, holder))
        self._num_published[request_id] = end
        return offered

    def free(self, request_id: str) -> None:
        """Drop the request's references (finish, abort, preemption); blocks nobody holds join the free queue,
        uncached ones at the front, cached ones at the back, the request's last block first."""
        self._num_published.pop(request_id, None)
        self._num_released.pop(request_id, None)
        self._release_blocks([block for block in reversed(self._blocks.pop(request_id, ())) if block != NO_BLOCK])

    def _release_blocks(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of `blocks`, in order (every release goes through here: one call per request
        freed or per window release, not one per block); a block nobody holds joins the free queue, at the front
        if it caches no prefix."""
        ref_cnt, free, block_hash = self._ref_cnt, self._free, self._block_hash
        for block in blocks:
            ref_cnt[block] -= 1
            if not ref_cnt[block]:
                free[block] = None
                if block_hash[block] is None:
                    free.move_to_end(block, last=False)

    def release_out_of_window(self, request_id: str, first_position: int) -> None:
        """Give back the request's blocks wholly before the window of position `first_position` (no query from
        there on reads them: a query at p reads keys from p - window + 1). Oldest first, so a cached prefix's
        blocks stay in the free queue's eviction order. Call only with a `window`."""
        first_kept = max(first_position - self.window + 1, 0) // self.block_size
        released = self._num_released.get(request_id, 0)
        if first_kept <= released:
            return
        blocks = self._blocks[request_id]
        end = min(first_kept, len(blocks))
        self._release_blocks([block for block in blocks[released:end] if block != NO_BLOCK])
        blocks[released:end] = [NO_BLOCK] * max(end - released, 0)
        self._num_released[request_id] = first_kept

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (held blocks stay held, unshared from now on): after a failed step, whose
        published blocks may never have been computed."""
        for block_hash, block in self._cached.items():
            self._block_hash[block] = None
            self.hooks.on_evicted(block, block_hash)
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()

    def unpublish(self, block_ids: Sequence[int]) -> None:
        """Forget the prefixes these blocks cache (their KV is not valid: a failed load); held blocks stay held."""
        for block in block_ids:
            block_hash = self._block_hash[block]
            if block_hash is not None:
                self._block_hash[block] = None
                del self._cached[block_hash]
                if self.events is not None:
                    self.events.removed(block_hash)
                self.hooks.on_evicted(block, block_hash)

    # ---- checks --------------------------------------------------------------------------------------
    def holders(self) -> set[str]:
        """Ids of the requests that hold at least one block."""
        return {request_id for request_id, blocks in self._blocks.items() if blocks}

    def check_conservation(self) -> None:
        """Raise `AssertionError` unless every block is either free or held, each held block's reference count
        is the number of requests holding it, and the hash map and the blocks' hashes agree."""
        held: dict[int, int] = {}
        for blocks in self._blocks.values():
            for block in blocks:
                if block != NO_BLOCK:
                    held[block] = held.get(block, 0) + 1
        free = set(self._free)
        if (
            len(free) != len(self._free)
            or free & held.keys()
            or len(free) + len(held) != self.num_blocks
            or free | held.keys() != set(range(self.num_blocks))
        ):
            raise AssertionError(
                f"KV block pool leak: {len(self._free)} free + {len(held)} in use != {self.num_blocks} total "
                f"(or a block is both free and held, or held twice)"
            )
        wrong = [b for b in range(self.num_blocks) if self._ref_cnt[b] != held.get(b, 0)]
        if wrong:
            raise AssertionError(
                f"KV block reference counts wrong for blocks {wrong[:8]}: counts "
                f"{[self._ref_cnt[b] for b in wrong[:8]]}, holders {[held.get(b, 0) for b in wrong[:8]]}"
            )
        hashed = {b: h for b, h in enumerate(self._block_hash) if h is not None}
        if len(hashed) != len(self._cached) or any(self._cached.get(h) != b for b, h in hashed.items()):
            raise AssertionError("prefix cache map out of step with the blocks' hashes")
        self.hooks.check(set(hashed))


def _lora_id(request: HashableRequest) -> Optional[int]:
    """The `lora_id` of the request's KV-cache events: its adapter's `int_id` (None: the base model)."""
    lora = getattr(request, "lora", None)  # engine requests have it; other hashable requests run the base model
    return None if lora is None else lora.int_id


def window_hit(cached: list[Optional[int]], kv: KVCacheManager) -> list[int]:
    """The longest usable hit under a sliding window: `cached[i]` is the block caching the request's i-th block
    (None if no block does). A hit of n blocks is usable when every block the window of its first computed
    token (position n * block_size) reads is cached: indices `(n * block_size - window + 1) // block_size .. n - 1`;
    the blocks before them come back as `NO_BLOCK` (they need not be cached). The longest such n is taken."""
    bs, window = kv.block_size, kv.window
    run = 0  # cached blocks ending at index i
    best = 0
    for i, block in enumerate(cached):
        run = run + 1 if block is not None else 0
        n = i + 1
        first_read = max(n * bs - window + 1, 0) // bs
        if run >= n - first_read:
            best = n
    first_read = max(best * bs - window + 1, 0) // bs
    return [NO_BLOCK] * first_read + [b for b in cached[first_read:best] if b is not None]
