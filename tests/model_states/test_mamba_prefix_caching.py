"""Prefix caching of a Mamba hybrid (Jamba): recurrent-state snapshots at block boundaries.

- the snapshot index alone: a hit ends at its last block with a readable snapshot; a snapshot written by the
  step being scheduled is not readable yet and its slot is not handed out again in that step; eviction of a
  block drops its snapshot; least recently used snapshots go first when slots run out;
- the scheduler asks for snapshots at the right (batch row, tokens) and starts a hit from the right slot;
- through the engine, on the tiny HF Jamba checkpoint of tests/model_states/test_mamba_hybrid.py: the same tokens with
and
  without prefix caching (greedy and seeded sampling) for requests sharing prefixes shorter than a block, of
  exactly a block and of many blocks, and for a second wave that continues the first wave's conversations;
  both runners, both scheduling modes, chunked prefill, small KV pools that preempt and evict, few snapshot
  slots that evict snapshots. Every step checks the block pool and the snapshot index (`check_invariants`);
  at the end every block is free with reference count 0, and after a cache reset every snapshot slot is free.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.hf_models import save_tiny_checkpoint
from helpers.leak_check import assert_engine_drained
from helpers.prefix_workload import first_wave, mixed_params
from test_mamba_hybrid import JAMBA, _batch, _OneMixer, _run

from framework import LLM, SamplingParams, load_config
from framework.config.schema import CacheConfig, SchedulerConfig
from framework.engine.request import Request
from framework.engine.scheduler.kv_cache_manager import KVCacheManager
from framework.engine.scheduler.scheduler import Scheduler
from framework.params.scheduler_output import StateSnapshot
from model_states.mamba_hybrid import MambaHybridModelState
from model_states.mamba_snapshots import MambaSnapshotIndex

MAX_MODEL_LEN = 96
MAX_TOKENS = 10


# ---- the snapshot index ----------------------------------------------------------------------------------
def test_hit_ends_at_the_last_block_with_a_readable_snapshot():
    index = MambaSnapshotIndex(4)
    index.on_schedule()
    assert index.usable_hit([7, 8, 9]) == 0  # no snapshot at all: no usable hit
    assert index.assign_snapshot(7) == 0 and index.assign_snapshot(9) == 1
    assert index.assign_snapshot(7) is None  # one snapshot per block
    assert index.usable_hit([7, 8, 9]) == 0 and index.snapshot_slot(7) is None  # pending: written this step
    index.on_schedule()
    assert index.usable_hit([7, 8, 9]) == 3 and index.snapshot_slot(9) == 1
    assert index.usable_hit([7, 8]) == 1  # block 8 has none: the hit ends at block 7
    assert index.usable_hit([8]) == 0
    index.on_evicted(9, b"h9")
    assert index.usable_hit([7, 8, 9]) == 1 and index.snapshot_slot(9) is None
    index.check({7, 8})
    with pytest.raises(AssertionError, match="not cached"):
        index.check({8})


def test_snapshot_slots_are_evicted_least_recently_used_but_never_in_their_own_step():
    index = MambaSnapshotIndex(2)
    index.on_schedule()
    assert (index.assign_snapshot(1), index.assign_snapshot(2)) == (0, 1)
    assert index.assign_snapshot(3) is None  # both slots pending: a second write in this step would race
    index.on_schedule()
    assert index.usable_hit([1]) == 1  # touch block 1: block 2 is now the least recently used
    assert index.assign_snapshot(3) == 1 and index.num_evictions == 1
    assert index.snapshot_slot(2) is None and index.snapshot_slot(1) == 0
    index.on_evicted(3, b"h3")  # evicted while pending: its slot is not free before the next step
    assert index.assign_snapshot(4) == 0  # (evicts block 1, the only readable one)
    assert index.assign_snapshot(5) is None
    index.check({4, 5})
    index.on_schedule()
    assert index.assign_snapshot(5) == 1  # the retired slot is free again
    index.on_schedule()
    for block in (4, 5):
        index.on_evicted(block, b"")
    index.check(set())
    assert index.num_snapshots == 0


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def test_scheduler_asks_for_snapshots_at_block_ends_and_starts_hits_from_them():
    """block_size 4, 7 tokens per step. "a" (10 tokens) snapshots after 4 tokens of its first chunk, then after
    1 token of the next (position 8); "b" shares a's first 9 tokens: its hit ends at block 1, from that slot."""
    index = MambaSnapshotIndex(8)
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, hooks=index)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7), kv, 64)
    a = list(range(10, 20))
    sched.add_request(_req("a", a))
    first = sched.schedule()
    assert first.state_snapshots == [StateSnapshot(0, 4, 0)]
    assert first.new_requests[0].snapshot_slot is None
    second = sched.schedule()
    assert second.state_snapshots == [StateSnapshot(0, 1, 1)]
    sched.add_request(_req("b", a[:9] + [1, 2]))
    third = sched.schedule()  # a decodes (row 0), b is admitted (row 1) with 8 cached tokens
    new_b = third.new_requests[0]
    assert (new_b.num_computed_tokens, new_b.snapshot_slot) == (8, 1)
    assert third.state_snapshots == []  # b computes positions 8..10: no block ends there
    kv.check_conservation()


def test_a_prefix_recomputed_for_lack_of_a_snapshot_gives_its_cached_block_one():
    """One snapshot slot. "a" snapshots its 2-block prompt's end; "x" takes the slot (evicting it); "d" repeats
    a's prompt, hits nothing usable, recomputes it and stores the snapshot for a's cached block (which "d"'s
    copy duplicates); "e" then hits both blocks and starts from that slot."""
    index = MambaSnapshotIndex(1)
    kv = KVCacheManager(32, 4, enable_prefix_caching=True, hooks=index)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16), kv, 64)
    a = list(range(10, 18))
    sched.add_request(_req("a", a))
    assert sched.schedule().state_snapshots == [StateSnapshot(0, 8, 0)]  # block 0 gets none: the slot is taken
    sched.add_request(_req("x", [1, 2, 3, 4, 5]))
    assert sched.schedule().state_snapshots == [StateSnapshot(1, 4, 0)]  # row 0 is a's decode step
    sched.add_request(_req("d", a + [7]))
    step = sched.schedule()
    assert step.new_requests[0].num_computed_tokens == 0 and step.state_snapshots == [StateSnapshot(2, 8, 0)]
    sched.add_request(_req("e", a + [9]))
    new_e = sched.schedule().new_requests[0]
    assert (new_e.num_computed_tokens, new_e.snapshot_slot, index.num_evictions) == (8, 0, 2)
    kv.check_conservation()


def test_a_hit_without_a_snapshot_is_refused_by_the_state():
    state = MambaHybridModelState(_OneMixer(), {}, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="no state snapshot"):
        state.add_request(0, SimpleNamespace(num_computed_tokens=16, request_id="r", snapshot_slot=None))


@torch.no_grad()
def test_a_request_started_from_a_snapshot_ends_where_a_full_run_ends():
    """Slot 0 runs 8 tokens and snapshots after 0, 5 and 8 of them; a request in slot 1 that starts from the
    5-token snapshot and runs the last 3 tokens ends in slot 0's state, and with its outputs."""
    model = _OneMixer()
    state = MambaHybridModelState(model, {}, 4, torch.device("cpu"))
    state.init_prefix_cache(CacheConfig(mamba_snapshot_slots=3))
    x = torch.randn(8, 16)
    state.add_request(0, SimpleNamespace(num_computed_tokens=0, request_id="a", snapshot_slot=None))
    state.apply_staged_writes()
    state.save_snapshots([StateSnapshot(0, 0, 1), StateSnapshot(0, 5, 2), StateSnapshot(0, 8, 0)])
    y_full = _run(state, model, x, _batch([0], [8], [0]))
    assert not torch.any(state.snapshot_pools[1][:, 1])  # the state before the step: zeros
    state.add_request(1, SimpleNamespace(num_computed_tokens=5, request_id="b", snapshot_slot=2))
    state.ssm_state[:, 1].fill_(9.0)  # garbage the restore must overwrite
    state.apply_staged_writes()
    y_tail = _run(state, model, x[5:], _batch([1], [3], [0]))
    torch.testing.assert_close(y_tail, y_full[5:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.ssm_state[:, 1], state.ssm_state[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.conv_state[:, 1], state.conv_state[:, 0])
    torch.testing.assert_close(state.snapshot_pools[1][:, 0], state.ssm_state[:, 0])
    assert state.snapshot_bytes == 24 * 3 * 4 + 24 * 6 * 4


# ---- through the engine ------------------------------------------------------------------------------------
# (runner, async scheduling, block size, KV blocks, snapshot slots, tokens per step): both runners and both
# scheduling modes; chunked prefill at a chunk size that is not a multiple of the block; the small KV pools
# preempt and evict, the small snapshot pools evict snapshots.
CASES = [
    ("v2", True, 4, 30, 6, 48),
    ("v1", False, 4, 200, 64, 13),
    ("v2", False, 16, 8, 3, 48),
    ("v1", True, 1, 110, 40, 48),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf-jamba-prefix")
    save_tiny_checkpoint(JAMBA, path)
    return path


def _engine_config(
    path: Path,
    runner: str,
    async_scheduling: bool,
    block_size: int,
    num_blocks: int,
    snapshot_slots: int,
    budget: int,
    caching: bool,
) -> dict:
    return {
        "model": {"path": str(path), "preset": None, "dtype": "float32", "max_model_len": MAX_MODEL_LEN},
        "runner": {"kind": runner},
        "device": "cpu",
        "cache": {
            "block_size": block_size,
            "num_blocks": num_blocks,
            "enable_prefix_caching": caching,
            "mamba_snapshot_slots": snapshot_slots,
        },
        "scheduler": {
            "max_num_seqs": 6,
            "max_num_batched_tokens": budget,
            "async_scheduling": async_scheduling,
            "check_invariants": True,
        },
    }


def _generate(config: dict, block_size: int):  # type: ignore[no-untyped-def]
    llm = LLM(config=load_config(config))
    wave = first_wave(block_size)
    first = llm.generate(wave, mixed_params(len(wave), MAX_TOKENS), use_tqdm=False)
    follow = [o.prompt_token_ids + o.token_ids + [7, 8, 9] for o in first[:4]]  # the conversations go on
    second = llm.generate(follow, mixed_params(len(follow), MAX_TOKENS), use_tqdm=False)
    outs = first + second
    assert_engine_drained(llm.engine)
    kv = llm.engine.kv_cache
    assert all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))
    index = kv.hooks
    if kv.enable_prefix_caching:
        assert isinstance(index, MambaSnapshotIndex) and index.num_snapshots > 0
        kv.check_conservation()  # every snapshot belongs to a cached block
        llm.reset_prefix_cache()
        index.check(set())
        assert index.num_snapshots == 0  # every snapshot slot free
    return (
        [o.token_ids for o in outs],
        sum(o.num_preemptions for o in outs),
        sum(o.num_cached_tokens for o in outs),
        llm.prefix_cache_stats,
        index,
    )


@pytest.mark.parametrize(
    "runner,async_scheduling,block_size,num_blocks,snapshot_slots,budget",
    CASES,
    ids=[f"{c[0]}-{'async' if c[1] else 'sync'}-bs{c[2]}-snap{c[4]}" for c in CASES],
)
def test_same_tokens_with_and_without_prefix_caching(
    checkpoint, one_thread, runner, async_scheduling, block_size, num_blocks, snapshot_slots, budget
):
    args = (checkpoint, runner, async_scheduling, block_size, num_blocks, snapshot_slots, budget)
    off, _, cached_off, stats_off, _ = _generate(_engine_config(*args, caching=False), block_size)
    on, preemptions, cached_on, stats_on, index = _generate(_engine_config(*args, caching=True), block_size)
    assert on == off
    assert cached_off == 0 and stats_off.queries == 0
    assert cached_on > 0 and stats_on.hits >= cached_on and 0 < stats_on.hit_rate < 1
    if num_blocks * block_size < 4 * MAX_MODEL_LEN:
        assert preemptions > 0, "the small pool was meant to preempt"
    if snapshot_slots < 8:
        assert index.num_evictions > 0, "the small snapshot pool was meant to evict"


def test_hybrid_prefix_caching_is_on_by_default_and_can_be_required(checkpoint):
    llm = LLM(str(checkpoint), device="cpu", max_model_len=MAX_MODEL_LEN)
    assert llm.engine.kv_cache.enable_prefix_caching
    state = llm.engine.runner.model_state
    assert state.snapshot_pools[1].shape[1] == 2 * llm.engine.config.scheduler.max_num_seqs
    assert LLM(
        str(checkpoint), device="cpu", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True
    ).engine.kv_cache.enable_prefix_caching
    off = LLM(str(checkpoint), device="cpu", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    assert not off.engine.kv_cache.enable_prefix_caching and off.engine.runner.model_state.snapshot_pools is None


def test_same_tokens_with_speculative_decoding(one_thread):
    """ngram drafts on repetitive prompts (jamba-tiny): rows verifying drafts take no snapshot past their first
    token, and the outputs with prefix caching equal those without, over two waves of shared prefixes."""
    rng = random.Random(0)
    pattern = [rng.randrange(250) for _ in range(6)]
    system = (pattern * 8)[:44]
    prompts = [system + pattern[:3], system[:10] + pattern, system + pattern * 2, system[:40]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
    ] * 2
    outs, cached = {}, {}
    for caching in (False, True):
        llm = LLM(
            config=load_config(
                {
                    "model": {"preset": "jamba-tiny"},
                    "device": "cpu",
                    "scheduler": {"check_invariants": True},
                    "cache": {"block_size": 4, "enable_prefix_caching": caching},
                    "speculator": {"method": "ngram", "num_speculative_tokens": 3},
                }
            )
        )
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate([o.prompt_token_ids + o.token_ids + [5] for o in first], params, use_tqdm=False)
        outs[caching] = [o.token_ids for o in first + second]
        cached[caching] = sum(o.num_cached_tokens for o in second)
        assert llm.engine.spec_metrics.num_drafts > 0
        assert_engine_drained(llm.engine)
    assert outs[True] == outs[False] and cached[True] > 0
