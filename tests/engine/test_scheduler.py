"""Scheduler and KV block pool, without a model."""

from __future__ import annotations

import pytest

from framework.config.schema import SchedulerConfig
from framework.engine.request import Request, RequestStatus
from framework.engine.scheduler.kv_cache_manager import KVCacheManager
from framework.engine.scheduler.scheduler import Scheduler
from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import CachedRequestData


def _req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(n)), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def _sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=64):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), kv, max_model_len), kv


def test_budget_chunks_prefill_and_decodes_first():
    s, _ = _sched(budget=10)
    s.add_request(_req("a", 7))
    s.add_request(_req("b", 9))
    out = s.schedule()
    assert out.scheduled_request_ids == ["a", "b"] and out.num_scheduled_tokens == [7, 3]
    s.update_from_output(out, [[1], []])  # a sampled; b's chunk samples nothing
    out = s.schedule()
    assert out.scheduled_request_ids == ["a", "b"] and out.num_scheduled_tokens == [1, 6]
    assert [n.request_id for n in out.new_requests] == []
    # Only rows that gained KV blocks are listed: a (block 4 tokens) still fits in its 2 blocks, b grows to 3.
    assert out.cached_requests == [CachedRequestData("b", [3, 4])]


def test_max_num_seqs_limits_running():
    s, _ = _sched(max_num_seqs=2)
    for i in range(3):
        s.add_request(_req(f"r{i}", 3))
    out = s.schedule()
    assert out.scheduled_request_ids == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_preemption_frees_newest_and_requeues_it_first():
    s, kv = _sched(num_blocks=4, block_size=4, budget=64)
    s.add_request(_req("old", 7, max_tokens=8))  # 2 blocks
    s.add_request(_req("new", 8, max_tokens=8))  # 2 blocks: pool full
    out = s.schedule()
    assert out.num_scheduled_tokens == [7, 8] and kv.num_free_blocks == 0
    s.update_from_output(out, [[1], [2]])
    out = s.schedule()  # "old" needs position 7 -> fits in its block 2; "new" needs a 3rd block: preempt "new"
    assert out.scheduled_request_ids == ["old"]
    new = s.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert s.waiting[0] is new
    assert kv.num_free_blocks == 2
    assert out.finished_request_ids == {"new"}  # the runner frees the preempted request's slot


def test_resumed_request_refills_prompt_and_output():
    s, kv = _sched(num_blocks=4, block_size=4, budget=64)
    s.add_request(_req("old", 7, max_tokens=8))
    s.add_request(_req("new", 8, max_tokens=8))
    s.update_from_output(s.schedule(), [[1], [2]])
    s.update_from_output(s.schedule(), [[3]])  # "new" preempted here
    while "old" in s.requests:
        s.update_from_output(s.schedule(), [[4]] * len(s.running))
    out = s.schedule()
    resumed = [n for n in out.new_requests if n.request_id == "new"][0]
    assert resumed.prompt_len == 8 and resumed.prefill_token_ids == list(range(8)) + [2]
    assert out.num_scheduled_tokens[out.scheduled_request_ids.index("new")] == 9


def test_finish_and_abort_free_blocks():
    s, kv = _sched()
    s.add_request(_req("a", 5, max_tokens=1))
    s.add_request(_req("b", 5, max_tokens=5))
    out = s.schedule()
    finished = s.update_from_output(out, [[9], [9]])
    assert [r.request_id for r in finished] == ["a"] and finished[0].status == RequestStatus.FINISHED_LENGTH
    assert s.abort_request("b").status == RequestStatus.FINISHED_ABORTED
    assert kv.num_free_blocks == kv.num_blocks and s.num_unfinished == 0
    assert s.schedule().finished_request_ids == {"a", "b"}  # the runner frees both slots


def test_many_requests_ending_in_one_step_leave_the_rest_in_order():
    """Rows that end in one `update_from_output` leave `running` in one pass: the others keep their order (the
    order rows are scheduled in and preemption picks its victim by), every ended slot is released once, and
    only decode rows that cross into a new block list new blocks."""
    s, kv = _sched(num_blocks=32, block_size=4, budget=64)
    lengths = {"r0": 1, "r1": 8, "r2": 1, "r3": 1, "r4": 8, "r5": 1}  # max_tokens: r0, r2, r3, r5 end first
    for rid, max_tokens in lengths.items():
        s.add_request(_req(rid, 5, max_tokens=max_tokens))
    out = s.schedule()
    finished = s.update_from_output(out, [[9]] * 6)
    assert [r.request_id for r in finished] == ["r0", "r2", "r3", "r5"]
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in finished)
    assert [r.request_id for r in s.running] == ["r1", "r4"]
    s.check_invariants()
    out = s.schedule()
    assert out.finished_request_ids == {"r0", "r2", "r3", "r5"} and out.scheduled_request_ids == ["r1", "r4"]
    assert kv.num_free_blocks == kv.num_blocks - 4
    assert kv.allocate("hog", kv.num_free_blocks * 4) is not None and kv.num_free_blocks == 0
    for _ in range(3):  # positions 5, 6, 7 fit in the 2 blocks each holds: no new blocks listed
        assert out.scheduled_request_ids == ["r1", "r4"] and out.cached_requests == []
        s.update_from_output(out, [[9], [9]])
        out = s.schedule()
    # Position 8 needs a 3rd block and none is free: the newest running request (r4) is preempted for r1.
    assert out.scheduled_request_ids == ["r1"] and [r.request_id for r in s.waiting] == ["r4"]
    assert out.cached_requests == [CachedRequestData("r1", out.cached_requests[0].new_block_ids)]
    assert len(out.cached_requests[0].new_block_ids) == 1 and out.finished_request_ids == {"r4"}


def test_requests_compare_by_identity():
    """Two requests with equal fields are different requests (queues find them with `is`)."""
    a, twin = _req("a", 3), _req("a", 3)
    assert a != twin and a == a and len({a, twin}) == 2


@pytest.mark.parametrize(
    "params, tokens, ends_at, status, stop_token_id",
    [
        ({}, [5, 2, 5], 2, "stop", None),  # eos
        ({"ignore_eos": True}, [5, 2, 5, 5], 4, "length", None),  # eos ignored: max_tokens=4
        ({"ignore_eos": True, "stop_token_ids": [2]}, [5, 2], 2, "stop", 2),  # eos listed as a stop id still stops
        ({"stop_token_ids": [7]}, [5, 7], 2, "stop", 7),
        ({"stop_token_ids": [7], "min_tokens": 3}, [7, 2, 7], 3, "stop", 7),  # stops count from min_tokens on
        ({"min_tokens": 2}, [2, 2], 2, "stop", None),
        ({"max_tokens": 50}, [5] * 6, 6, "length", None),  # max_model_len: prompt 10 + 6 outputs = 16
    ],
)
def test_stop_conditions_per_token(params, tokens, ends_at, status, stop_token_id):
    """`update_from_output` ends a request at the first token that meets a stop condition, whatever the
    order: eos (unless ignored), stop_token_ids (reported), both only from min_tokens on, then length."""
    s, _ = _sched(max_model_len=16)
    params = {"temperature": 0, "max_tokens": 4, **params}
    s.add_request(Request("a", list(range(10, 20)), SamplingParams(**params), eos_token_id=2))
    request = s.requests["a"]
    for i, token in enumerate(tokens, 1):
        finished = s.update_from_output(s.schedule(), [[token]])
        assert (finished == [request]) == (i == ends_at), (i, request.status)
        if finished:
            break
    assert request.status.value == status and request.stop_token_id == stop_token_id
    assert request.output_token_ids == tokens[:ends_at]
