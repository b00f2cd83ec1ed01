"""The KV cache manager of a model with KV groups (`framework.params.kv_groups`): one pool, one block list per
group per request, and window groups that give back what their window no longer reads.

A request's blocks are kept interleaved in position order (`_blocks`, what `table_row` and the runner's
`GroupedBlockTables` read): position block `j` of group `g` is entry `j * G + g`, and every group has an entry for
every position block, `NO_BLOCK` where a window group gave its block back. Group 0 is a full group: its list (one
id per position block) is what the scheduler's growth test reads (`growth_views`). docs/sliding-window.md#kv-memory.

Prefix caching publishes each group's blocks under its own key (group 0 under the block's hash, group `g` under
`g` + the hash). A hit of `n` blocks is usable when every full group caches blocks `0 .. n - 1` and every window
group caches the blocks the window of the first computed token (position `n * block_size`) reads; the longest
such `n` is taken (`find_cached_blocks`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from framework.engine.scheduler.kv_cache_manager import NO_BLOCK, KVCacheManager
from framework.params.prefix_cache import BlockHash, HashableRequest, PrefixCacheHooks, extend_block_hashes


class GroupedHit(list):  # type: ignore[type-arg]
    """A prefix-cache hit under KV groups. As a list: group 0's blocks, one per hit block (the scheduler reads the
    hit's length in blocks and its last block); `interleaved`: every group's blocks as the request will hold
    them (`NO_BLOCK` before a window group's window)."""

    def __init__(self, group0: list[int], interleaved: list[int]) -> None:
        super().__init__(group0)
        self.interleaved = interleaved


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of group `group`'s block for the prefix `block_hash` (group 0: the hash itself)."""
    return block_hash if group == 0 else _GROUP_PREFIXES[group] + block_hash


_GROUP_PREFIXES = tuple(bytes([group]) for group in range(256))  # built once: keys are made per block per group


class GroupedKVCacheManager(KVCacheManager):
    """`KVCacheManager` over one pool for `len(group_windows)` KV groups (`group_windows[g]`: group g's window
    in keys, 0 for a full group; group 0 is full). Each position block a request grows by takes one block per
    group; `release_out_of_window` gives back each window group's blocks its window no longer reads."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        group_windows: Sequence[int],
        enable_prefix_caching: bool = False,
        hooks: Optional[PrefixCacheHooks] = None,
    ) -> None:
        if not group_windows or group_windows[0]:
            raise ValueError(f"KV groups {list(group_windows)}: group 0 must be a full-attention group (window 0)")
        super().__init__(num_blocks, block_size, enable_prefix_caching, hooks, window=max(group_windows))
        self.group_windows = tuple(group_windows)
        self.num_groups = len(group_windows)
        self._position_blocks: dict[str, list[int]] = {}  # per request: group 0's blocks (one per position block)
        self._group_released: dict[str, list[int]] = {}  # per request, per group: leading blocks given back

    def growth_views(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        """(group 0's blocks per request: one per position block, leading position blocks published)."""
        return self._position_blocks, self._num_published

    def num_held_blocks(self, request_id: str) -> int:
        """Block ids the request holds now, over every group (given-back ones not counted)."""
        return sum(1 for block in self._blocks.get(request_id, ()) if block != NO_BLOCK)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New block ids (one per group per position block) so that `num_tokens` positions have a KV slot."""
        have = len(self._position_blocks.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have) * self.num_groups

    def _first_read(self, group: int, num_blocks: int) -> int:
        """The first position block group `group` reads for a query at position `num_blocks * block_size`."""
        window = self.group_windows[group]
        return max(num_blocks * self.block_size - window + 1, 0) // self.block_size if window else 0

    # ---- prefix cache lookups ------------------------------------------------------------------------
    def find_cached_blocks(self, request: HashableRequest, num_tokens: int) -> list[int]:
        """The longest hit every group can serve, as a `GroupedHit` (no references taken: pass it to `allocate`)."""
        if not self.enable_prefix_caching:
            return []
        hashes = extend_block_hashes(request, num_tokens, self.block_size)[: num_tokens // self.block_size]
        # A hit of n blocks needs group 0 (full) to cache blocks 0 .. n - 1: no group is looked up past group 0's
        # first miss (a new prompt costs one lookup, not one per block per group).
        lookup = self._cached.get
        group0: list[Optional[int]] = []
        for h in hashes:
            block = lookup(h)
            if block is None:
                break
            group0.append(block)
        hashes = hashes[: len(group0)]
        groups = range(self.num_groups)
        cached = [group0] + [[lookup(_GROUP_PREFIXES[g] + h) for h in hashes] for g in groups[1:]]
        n = self._longest_hit(cached)
        firsts = [self._first_read(g, n) for g in groups]
        interleaved = [
            cached[g][j] if j >= firsts[g] else NO_BLOCK  # type: ignore[misc]
            for j in range(n)
            for g in groups
        ]
        return GroupedHit(cached[0][:n], interleaved)

    def _longest_hit(self, cached: list[list[Optional[int]]]) -> int:
        """The largest n such that every group caches the blocks a query at position n * block_size reads."""
        runs = []  # per group: cached blocks in a row ending at each index
        for blocks in cached:
            run, ending = 0, []
            for block in blocks:
                run = run + 1 if block is not None else 0
                ending.append(run)
            runs.append(ending)
        for n in range(len(cached[0]), 0, -1):
            if all(runs[g][n - 1] >= n - self._first_read(g, n) for g in range(self.num_groups)):
                return n
        return 0

    # ---- allocation ----------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request to cover `num_tokens` positions in every group; the new block ids interleaved (one per
        group per new position block), or None if too few are free. `cached_blocks`: a `GroupedHit`."""
        position_blocks = self._position_blocks.get(request_id)
        if position_blocks is not None and num_tokens <= len(position_blocks) * self.block_size:
            return []
        if cached_blocks and position_blocks:
            raise RuntimeError(f"request '{request_id}' already holds blocks: cache hits start a request")
        hit = list(getattr(cached_blocks, "interleaved", cached_blocks))
        groups = self.num_groups
        if len(hit) % groups:
            raise ValueError(f"a hit of {len(hit)} blocks is not one block per KV group per position block")
        need = self.blocks_needed(request_id, num_tokens) - len(hit)
        revived = sum(1 for b in hit if b != NO_BLOCK and self._ref_cnt[b] == 0)  # now in the free queue
        if need + revived > len(self._free):
            return None
        released = self._group_released.setdefault(request_id, [0] * groups)
        for index, block in enumerate(hit):
            if block == NO_BLOCK:  # before the window of the hit's first computed token
                released[index % groups] += 1
                continue
            if self._ref_cnt[block] == 0:
                del self._free[block]
            self._ref_cnt[block] += 1
        taken = self._take_free_blocks(max(need, 0))
        # Each group takes a run of the free queue (on a fresh pool, consecutive ids), interleaved afterwards: a
        # group's position blocks then lie side by side in the KV tensors rather than G blocks apart.
        per_group, new = len(taken) // groups, list(taken)
        for group in range(groups):
            new[group::groups] = taken[group * per_group : (group + 1) * per_group]
        added = hit + new
        self._blocks.setdefault(request_id, []).extend(added)
        self._position_blocks.setdefault(request_id, []).extend(added[0::groups])
        if hit:
            self._num_published[request_id] = len(hit) // groups
        return new

    def release_out_of_window(self, request_id: str, first_position: int) -> None:
        """Give back every window group's blocks wholly before the window of position `first_position` (oldest
        first); full groups keep theirs."""
        blocks, groups, block_size = self._blocks[request_id], self.num_groups, self.block_size
        released = self._group_released[request_id]
        num_position_blocks = len(blocks) // groups
        for group, window in enumerate(self.group_windows):
            if not window:
                continue  # a full group keeps every block
            first_kept = min(max(first_position - window + 1, 0) // block_size, num_position_blocks)
            if first_kept <= released[group]:
                continue  # every decode step but one in block_size: nothing new falls out of the window
            run = slice(group + released[group] * groups, group + first_kept * groups, groups)  # group's entries
            self._release_blocks([block for block in blocks[run] if block != NO_BLOCK])
            blocks[run] = [NO_BLOCK] * (first_kept - released[group])
            released[group] = first_kept

    def cache_blocks(self, request: HashableRequest, num_tokens: int) -> list[tuple[int, int]]:
        """Publish every group's blocks of the request's full position blocks within its first `num_tokens`
        positions (a window group's given-back ones excepted); returns group 0's (index, caching block) pairs
        offered by this call, as `KVCacheManager.cache_blocks` does."""
        if not self.enable_prefix_caching:
            return []
        request_id, bs, groups = request.request_id, self.block_size, self.num_groups
        start = self._num_published.get(request_id, 0)
        if num_tokens < (start + 1) * bs:
            return []
        blocks = self._blocks.get(request_id, [])
        end = min(num_tokens // bs, len(blocks) // groups)
        if end <= start:
            return []
        hashes = extend_block_hashes(request, end * bs, bs)
        offered = []
        cached, block_hash, on_cached, prefixes = self._cached, self._block_hash, self.hooks.on_cached, _GROUP_PREFIXES
        for index in range(start, end):
            position_hash = hashes[index]
            for group, block in enumerate(blocks[index * groups : (index + 1) * groups]):
                if block == NO_BLOCK or block_hash[block] is not None:
                    continue  # given back, or already caching a prefix (a hit block)
                key = prefixes[group] + position_hash if group else position_hash  # `group_key`, inlined
                if key not in cached:
                    block_hash[block] = key
                    cached[key] = block
                    on_cached(block, key)
            holder = cached.get(position_hash)
            if holder is not None:
                offered.append((index, holder))
        self._num_published[request_id] = end
        return offered

    def free(self, request_id: str) -> None:
        """Drop the request's references in every group (finish, abort, preemption)."""
        super().free(request_id)
        self._position_blocks.pop(request_id, None)
        self._group_released.pop(request_id, None)
