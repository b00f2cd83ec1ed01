"""Prefix caching without a model: block hashes, the block pool's sharing / eviction, the scheduler's hits."""

from __future__ import annotations

import hashlib

import pytest
from helpers.leak_check import assert_no_leaks

from framework.config.schema import SchedulerConfig
from framework.engine.request import Request
from framework.engine.scheduler.kv_cache_manager import KVCacheManager
from framework.engine.scheduler.scheduler import Scheduler
from framework.params.pooling_params import PoolingParams
from framework.params.prefix_cache import ROOT_HASH, PrefixCacheHooks, extend_block_hashes, hash_block
from framework.params.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _req(rid: str, tokens: list[int], **params) -> Request:
    return Request(
        rid, list(tokens), SamplingParams(**{"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, **params})
    )


# ---- hashes ------------------------------------------------------------------------------------------------
def test_block_hash_is_sha256_of_parent_tokens_and_keys():
    expected = hashlib.sha256(
        ROOT_HASH
        + (3).to_bytes(8, "little")
        + b"".join(t.to_bytes(8, "little") for t in (1, 2, 300000))
        + b"s"
        + (4).to_bytes(8, "little")
        + b"lora"
    ).digest()
    assert hash_block(ROOT_HASH, [1, 2, 300000], ("lora",)) == expected
    base = hash_block(ROOT_HASH, [1, 2, 3])
    assert hash_block(ROOT_HASH, [1, 2, 3]) == base  # deterministic (no per-process salt)
    assert (
        len(
            {
                base,
                hash_block(ROOT_HASH, [1, 2, 4]),
                hash_block(base, [1, 2, 3]),
                hash_block(ROOT_HASH, [1, 2, 3], (1,)),
                hash_block(ROOT_HASH, [1, 2, 3], ("1",)),
                hash_block(ROOT_HASH, [1, 2, 3], (b"1",)),
            }
        )
        == 6
    )
    with pytest.raises(TypeError, match="extra keys are str, bytes or int"):
        hash_block(ROOT_HASH, [1], (1.5,))  # type: ignore[arg-type]


def test_block_hashes_extend_incrementally_across_prompt_and_output():
    request = _req("a", list(range(10)))
    assert extend_block_hashes(request, 10, 4) == request.block_hashes and len(request.block_hashes) == 2
    request.output_token_ids += [10, 11, 12]  # block 2 = prompt 8, 9 + output 10, 11
    extend_block_hashes(request, 13, 4)
    whole = _req("b", list(range(13)))
    assert request.block_hashes == extend_block_hashes(whole, 13, 4)  # same tokens, same chain
    other = _req("c", list(range(10)))
    other.cache_extra_keys = ("encoder-input-hash",)
    assert extend_block_hashes(other, 10, 4)[0] != request.block_hashes[0]


def _sha256_block(parent: bytes, tokens: list[int], extra: tuple = ()) -> bytes:
    """The documented block hash, written out here: sha256(parent, token count, tokens, then each extra key)."""
    data = parent + len(tokens).to_bytes(8, "little") + b"".join(t.to_bytes(8, "little") for t in tokens)
    for key in extra:
        raw = key.encode() if isinstance(key, str) else key
        data += b"s" + len(raw).to_bytes(8, "little") + raw
    return hashlib.sha256(data).digest()


@pytest.mark.parametrize("extra", [(), ("lora",)])
def test_each_block_hash_is_the_hash_of_its_parent_and_its_tokens(extra):
    """Every link of the chain, prompt and output blocks alike, against hashlib directly: a chain that drops
    its parent or slices the wrong tokens fails here even when two chains built the same way agree."""
    request = _req("a", [5, 900, 7, 31, 2, 77, 8, 150000, 3, 4])
    request.cache_extra_keys = extra
    request.output_token_ids += [61, 62, 63, 64, 65]
    hashes = extend_block_hashes(request, 15, 4)
    tokens = request.prompt_token_ids + request.output_token_ids
    assert len(hashes) == 3
    parent = ROOT_HASH
    for index, block_hash in enumerate(hashes):
        assert block_hash == _sha256_block(parent, tokens[index * 4 : (index + 1) * 4], extra), index
        parent = block_hash


# ---- the block pool --------------------------------------------------------------------------------------
def test_blocks_are_shared_by_reference_and_stay_cached_after_free():
    kv = KVCacheManager(6, 4, enable_prefix_caching=True)
    a = _req("a", list(range(9)))
    assert kv.allocate("a", 9) is not None
    kv.cache_blocks(a, 9)  # blocks 0, 1 full: published; block 2 holds one token
    assert kv.num_cached_blocks == 2
    b = _req("b", list(range(8)) + [99, 98])
    hit = kv.find_cached_blocks(b, 9)
    assert hit == kv.blocks_of("a")[:2]
    new = kv.allocate("b", 10, hit)
    assert len(new) == 1 and kv.blocks_of("b") == hit + new
    assert [kv.ref_count(blk) for blk in hit] == [2, 2]
    kv.free("a")
    kv.free("b")
    kv.check_conservation()
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 2  # freed, still cached
    c = _req("c", list(range(8)) + [7])
    assert kv.find_cached_blocks(c, 8) == hit  # hit on free blocks: they leave the free queue
    kv.allocate("c", 9, hit)
    assert kv.num_free_blocks == 3 and [kv.ref_count(blk) for blk in hit] == [1, 1]
    kv.free("c")
    kv.check_conservation()


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed():
    kv = KVCacheManager(6, 2, enable_prefix_caching=True)
    a, b = _req("a", [1, 2, 3, 4, 5]), _req("b", [6, 7, 8])
    kv.allocate("a", 5)
    kv.cache_blocks(a, 5)  # a: 2 cached blocks + 1 partial
    kv.allocate("b", 3)
    kv.cache_blocks(b, 3)  # b: 1 cached + 1 partial
    blocks_a, blocks_b = kv.blocks_of("a"), kv.blocks_of("b")
    kv.free("a")  # a's cached blocks join the back last-block-first, its partial block the front
    kv.free("b")
    assert kv.num_cached_blocks == 3
    order = kv._take_free_blocks(6)
    assert order[:3] == [blocks_b[1], blocks_a[2], 5]  # uncached (b's partial freed last: at the very front)
    assert order[3:] == [blocks_a[1], blocks_a[0], blocks_b[0]]  # cached, least recently freed first
    assert kv.num_cached_blocks == 0  # every cached block was evicted on the way out


def test_duplicate_blocks_stay_private_and_a_full_pool_refuses():
    kv = KVCacheManager(4, 2, enable_prefix_caching=True)
    a, b = _req("a", [1, 2, 3]), _req("b", [1, 2, 3])
    kv.allocate("a", 3)
    kv.allocate("b", 3)  # b missed the cache (both admitted before either published)
    kv.cache_blocks(a, 3)
    kv.cache_blocks(b, 3)  # same hash as a's block: not published twice
    assert kv.num_cached_blocks == 1
    assert kv.allocate("c", 3) is None  # 0 free blocks
    kv.free("b")
    kv.free("a")
    kv.check_conservation()
    c = _req("c", [1, 2, 9, 9, 9])
    hit = kv.find_cached_blocks(c, 4)
    assert hit == kv_blocks_with_hash(kv, 1) and kv.allocate("c", 6, hit) is not None
    assert kv.num_free_blocks == 1


def kv_blocks_with_hash(kv: KVCacheManager, expected: int) -> list[int]:
    blocks = [b for b, h in enumerate(kv._block_hash) if h is not None]
    assert len(blocks) == expected
    return blocks


def test_hooks_see_cached_and_evicted_blocks_and_can_shorten_hits():
    class Snapshots(PrefixCacheHooks):
        def __init__(self) -> None:
            self.cached: set[int] = set()
            self.log: list[tuple[str, int]] = []

        def on_cached(self, block_id, block_hash):  # type: ignore[no-untyped-def]
            self.cached.add(block_id)
            self.log.append(("cached", block_id))

        def on_evicted(self, block_id, block_hash):  # type: ignore[no-untyped-def]
            self.cached.discard(block_id)
            self.log.append(("evicted", block_id))

        def usable_hit(self, block_ids):  # type: ignore[no-untyped-def]
            return min(len(block_ids), 1)  # e.g. a snapshot only at the first block boundary

    hooks = Snapshots()
    kv = KVCacheManager(3, 2, enable_prefix_caching=True, hooks=hooks)
    a = _req("a", [1, 2, 3, 4, 5])
    kv.allocate("a", 5)
    kv.cache_blocks(a, 5)
    assert hooks.cached == set(kv.blocks_of("a")[:2])
    assert kv.find_cached_blocks(_req("b", [1, 2, 3, 4, 6]), 4) == kv.blocks_of("a")[:1]
    kv.free("a")
    kv.allocate("z", 6)  # takes all 3 blocks: both cached ones are evicted
    assert hooks.cached == set() and [e for e, _ in hooks.log] == ["cached", "cached", "evicted", "evicted"]
    kv.free("z")
    kv.cache_blocks(a, 0)
    kv.reset_prefix_cache()
    kv.check_conservation()


def test_reset_forgets_every_prefix():
    kv = KVCacheManager(4, 2, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3, 4, 5])
    kv.allocate("a", 5)
    kv.cache_blocks(a, 5)
    kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 0 and kv.find_cached_blocks(_req("b", [1, 2, 3, 4, 5]), 4) == []
    kv.free("a")
    kv.check_conservation()


def test_disabled_cache_never_hashes_or_hits():
    kv = KVCacheManager(4, 2)
    a = _req("a", [1, 2, 3, 4, 5])
    kv.allocate("a", 5)
    kv.cache_blocks(a, 5)
    assert a.block_hashes == [] and kv.find_cached_blocks(_req("b", [1, 2, 3, 4, 5]), 4) == []


# ---- the scheduler -----------------------------------------------------------------------------------------
def _sched(num_blocks=16, block_size=4, budget=64):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, async_scheduling=False), kv, 64), kv


def _sample(s: Scheduler, out) -> None:  # type: ignore[no-untyped-def]
    """Every row that completed its tokens this step samples token 7 (a prefill chunk samples nothing)."""
    s.update_from_output(out, [[7] if s.requests[r].num_output_placeholders else [] for r in out.scheduled_request_ids])


def _finish_all(s: Scheduler) -> None:
    for _ in range(200):
        if not s.requests:
            return
        _sample(s, s.schedule())
    raise AssertionError("requests hang")


def test_hit_skips_whole_blocks_but_always_computes_the_last_prompt_token():
    s, kv = _sched()
    s.add_request(_req("a", list(range(8))))
    out = s.schedule()
    s.update_from_output(out, [[50]])
    # Same step: "b" is admitted after "a" published its 2 full blocks; exact same prompt -> hit 1 block only.
    s.add_request(_req("b", list(range(8))))
    s.add_request(_req("c", list(range(9))))  # one more token: both blocks hit
    s.add_request(_req("d", list(range(3))))  # shorter than a block: no hit
    out = s.schedule()
    new = {n.request_id: n for n in out.new_requests}
    assert new["b"].num_computed_tokens == 4 and new["c"].num_computed_tokens == 8
    assert new["d"].num_computed_tokens == 0
    assert dict(zip(out.scheduled_request_ids, out.num_scheduled_tokens)) == {"a": 1, "b": 4, "c": 1, "d": 3}
    assert new["c"].block_ids[:2] == kv.blocks_of("a")[:2] and new["b"].block_ids[0] == kv.blocks_of("a")[0]
    assert kv.stats.queries == 8 + 8 + 9 + 3 and kv.stats.hits == 0 + 4 + 8 + 0
    _sample(s, out)
    _finish_all(s)
    assert_no_leaks(s)
    assert all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))


def test_prompt_logprobs_and_mean_pooling_read_nothing_but_publish():
    s, kv = _sched()
    s.add_request(_req("a", list(range(9))))
    s.update_from_output(s.schedule(), [[1]])
    s.add_request(_req("lp", list(range(9)), prompt_logprobs=2))
    mean = _req("mean", list(range(9)))
    mean.pooling_params = PoolingParams(pooling_type="mean")
    last = _req("last", list(range(9)))
    last.pooling_params = PoolingParams(pooling_type="last")
    s.add_request(mean)
    s.add_request(last)
    out = s.schedule()
    new = {n.request_id: n.num_computed_tokens for n in out.new_requests}
    assert new == {"lp": 0, "mean": 0, "last": 8}
    assert kv.stats.queries == 9 + 9 and kv.stats.hits == 8  # only "a" and "last" looked up
    _sample(s, out)
    _finish_all(s)
    assert_no_leaks(s)


def test_preempted_request_resumes_from_its_own_cached_blocks():
    s, kv = _sched(num_blocks=6, block_size=4)
    s.add_request(_req("old", list(range(100, 107)), max_tokens=5))  # 7 tokens: 2 blocks, then a 3rd (12 tokens)
    s.add_request(_req("new", list(range(200, 212)), max_tokens=12))  # 12 tokens: 3 blocks, then a 4th: preempted
    victim = s.requests["new"]
    for _ in range(20):
        out = s.schedule()
        _sample(s, out)
        if victim.num_preemptions:
            break
    assert victim.num_preemptions == 1 and victim.num_computed_tokens == 0
    for _ in range(50):
        out = s.schedule()
        resumed = [n for n in out.new_requests if n.request_id == "new"]
        _sample(s, out)
        if resumed:
            break
    # Resumed with prompt + 2 output tokens (14): its 3 prompt blocks were still cached; block 3 was never full.
    assert len(resumed[0].prefill_token_ids) == 14 and resumed[0].num_computed_tokens == 12
    assert kv.stats.queries == 7 + 12 + 14 and kv.stats.hits == 12
    _finish_all(s)
    assert_no_leaks(s)
