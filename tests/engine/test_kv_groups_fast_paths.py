"""The grouped KV manager's per-step paths against their definitions: `find_cached_blocks` (which looks no group
up past group 0's first miss), `cache_blocks` and `release_out_of_window` (which give back through one
`_release_blocks` call per group, the hook the engine tests poison released blocks through), and `allocate`, which
hands each group a run of the free queue."""

from __future__ import annotations

import random
from typing import Optional, Sequence

from framework.engine.request import Request
from framework.engine.scheduler.kv_cache_manager import NO_BLOCK
from framework.engine.scheduler.kv_groups import GroupedKVCacheManager, group_key
from framework.params.prefix_cache import extend_block_hashes
from framework.params.sampling_params import SamplingParams

BLOCK = 4
WINDOWS = (0, 6, 0, 10)  # two full groups, window groups of two sizes


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def _first_read(window: int, n: int) -> int:
    return max(n * BLOCK - window + 1, 0) // BLOCK if window else 0


def _hit_by_definition(cached: list[list[Optional[int]]]) -> tuple[list[int], list[int]]:
    """(group 0's blocks, the interleaved hit) of the largest n whose every group caches what position n reads."""
    best = 0
    for n in range(1, len(cached[0]) + 1):
        if all(all(cached[g][j] is not None for j in range(_first_read(w, n), n)) for g, w in enumerate(WINDOWS)):
            best = n
    interleaved = [
        cached[g][j] if j >= _first_read(w, best) else NO_BLOCK  # type: ignore[misc]
        for j in range(best)
        for g, w in enumerate(WINDOWS)
    ]
    return cached[0][:best], interleaved  # type: ignore[return-value]


def test_hit_matches_its_definition_on_random_caches() -> None:
    """Random publications per group (dense runs, holes in group 0 and in the window groups): the hit equals
    the longest n every group serves, with `NO_BLOCK` before each window group's window."""
    rng = random.Random(0)
    for trial in range(200):
        kv = GroupedKVCacheManager(512, BLOCK, WINDOWS, enable_prefix_caching=True)
        request = _req(f"r{trial}", [rng.randrange(50) for _ in range(rng.randrange(1, 60))])
        hashes = extend_block_hashes(request, request.num_tokens, BLOCK)
        density = rng.choice([0.5, 0.9, 1.0])
        cached: list[list[Optional[int]]] = [[None] * len(hashes) for _ in WINDOWS]
        next_block = 0
        for g in range(len(WINDOWS)):
            for j, h in enumerate(hashes):
                if rng.random() < density:
                    cached[g][j] = next_block
                    kv._cached[group_key(h, g)] = next_block
                    next_block += 1
        hit = kv.find_cached_blocks(request, request.num_tokens)
        group0, interleaved = _hit_by_definition(cached)
        assert list(hit) == group0 and hit.interleaved == interleaved, f"trial {trial}"  # type: ignore[attr-defined]


def test_publications_and_releases_follow_their_definitions() -> None:
    """A request growing in chunks, its window groups giving back behind the window: after each step every held,
    unpublished block of a full position block is published under its group's key, every entry before a
    window is `NO_BLOCK`, and each block given back passed through `_release_blocks` exactly once."""
    kv = GroupedKVCacheManager(1024, BLOCK, WINDOWS, enable_prefix_caching=True)
    released: list[int] = []
    release = kv._release_blocks

    def recording_release(blocks: Sequence[int]) -> None:
        released.extend(blocks)
        release(blocks)

    kv._release_blocks = recording_release  # type: ignore[method-assign]
    request = _req("a", [(7 * i) % 31 for i in range(90)])
    taken: list[int] = []
    for computed in range(0, 90, 11):
        if computed:  # as the scheduler does: a running request gives back before it grows
            kv.release_out_of_window("a", computed)
        new = kv.allocate("a", min(computed + 11, 90))
        assert new is not None
        taken += new
        kv.cache_blocks(request, min(computed + 11, 90))
        blocks, groups = kv.blocks_of("a"), len(WINDOWS)
        hashes = extend_block_hashes(request, min(computed + 11, 90), BLOCK)
        for j in range(len(blocks) // groups):
            for g, w in enumerate(WINDOWS):
                block = blocks[j * groups + g]
                gone = j < (max(computed - w + 1, 0) // BLOCK if w else 0)
                assert (block == NO_BLOCK) == gone, (computed, j, g)
                if not gone and j < len(hashes):
                    assert kv._cached[group_key(hashes[j], g)] == block
        kv.check_conservation()
    assert len(released) == len(set(released)) and set(released) <= set(taken)
    kv.free("a")
    assert sorted(released) == sorted(taken) and kv.num_free_blocks == 1024


def test_each_group_takes_a_run_of_the_free_queue() -> None:
    """A chunk's new blocks, on a fresh pool: each group's are consecutive ids (its K/V side by side in the KV
    tensors), still listed interleaved (position block j of group g at j * G + g)."""
    kv = GroupedKVCacheManager(256, BLOCK, WINDOWS)
    new = kv.allocate("a", 10 * BLOCK)
    assert new is not None and sorted(new) == list(range(40))
    groups = len(WINDOWS)
    for g in range(groups):
        assert new[g::groups] == list(range(g * 10, (g + 1) * 10))
    assert kv.blocks_of("a") == new
