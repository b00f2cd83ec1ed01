"""The scheduler with drafts, without a model: 1 + k tokens per decoding row within every limit, host counts
corrected from the outputs, drafts forgotten on preemption, metrics and policy fed from the outputs."""

from __future__ import annotations

import pytest

from framework.config.schema import SchedulerConfig
from framework.engine.request import Request, RequestStatus
from framework.engine.scheduler.kv_cache_manager import KVCacheManager
from framework.engine.scheduler.scheduler import Scheduler
from framework.params.sampling_params import SamplingParams
from speculators.metrics import SpecDecodeMetrics
from speculators.policy import FixedK


def _req(rid: str, n: int, max_tokens: int = 20, **params) -> Request:
    return Request(rid, list(range(n)), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params))


def _sched(k=3, num_blocks=64, block_size=4, budget=32, max_model_len=64, max_num_seqs=8):
    kv = KVCacheManager(num_blocks, block_size)
    metrics = SpecDecodeMetrics()
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, kv, max_model_len, FixedK(k), metrics), kv, metrics


def test_decode_rows_verify_k_drafts_and_counts_are_corrected():
    s, kv, metrics = _sched(k=3)
    s.add_request(_req("a", 6))
    out = s.schedule()
    assert out.num_scheduled_tokens == [6] and out.num_draft_tokens == [0] and out.num_propose_tokens == 3
    s.update_from_output(out, [[100]])
    out = s.schedule()  # decode: last sampled token + 3 drafts
    assert out.num_scheduled_tokens == [4] and out.num_draft_tokens == [3]
    a = s.requests["a"]
    assert a.num_computed_tokens == 10 and a.num_output_placeholders == 4
    s.update_from_output(out, [[101, 102]])  # 1 draft accepted, 2 rejected
    assert a.output_token_ids == [100, 101, 102]
    assert a.num_output_placeholders == 0
    assert a.num_computed_tokens == 8  # 6 prompt + 100 + 101 computed; 102's KV comes next step
    out = s.schedule()
    assert out.num_scheduled_tokens == [4] and a.num_computed_tokens == 12
    assert metrics.num_drafts == 1 and metrics.num_draft_tokens == 3 and metrics.num_accepted_tokens == 1
    assert metrics.per_position_acceptance == [1.0, 0.0, 0.0]
    assert kv.num_used_blocks * 4 >= 12


def test_async_scheduling_counts_upper_bounds_until_outputs_arrive():
    s, _, _ = _sched(k=2)
    s.add_request(_req("a", 5))
    out1 = s.schedule()  # prefill; samples
    out2 = s.schedule()  # output of 1 not seen yet: decode row, drafts proposed after step 1
    assert out2.num_draft_tokens == [2] and out2.num_scheduled_tokens == [3]
    a = s.requests["a"]
    assert a.num_output_placeholders == 4 and a.num_computed_tokens == 8
    s.update_from_output(out1, [[7]])
    out3 = s.schedule()
    assert out3.num_draft_tokens == [2]
    s.update_from_output(out2, [[8]])  # both drafts of step 2 rejected
    assert a.num_computed_tokens == 11 - 2 and a.num_output_placeholders == 3
    s.update_from_output(out3, [[9, 10, 11]])  # all accepted
    assert a.output_token_ids == [7, 8, 9, 10, 11] and a.num_output_placeholders == 0
    assert a.num_computed_tokens == 5 + 5 - 1  # the last token's KV is computed by the next step


def test_drafts_capped_by_max_model_len_and_budget_not_max_tokens():
    s, _, _ = _sched(k=5, budget=32)
    s.add_request(_req("t", 4, max_tokens=3))
    out = s.schedule()
    s.update_from_output(out, [[1]])
    out = s.schedule()
    assert out.num_draft_tokens == [5]  # the batch stays uniform (CUDA graph); extra tokens are dropped
    finished = s.update_from_output(out, [[2, 3, 4, 5, 6, 7]])  # every draft accepted
    assert [r.request_id for r in finished] == ["t"] and finished[0].output_token_ids == [1, 2, 3]
    s2, _, _ = _sched(k=5, max_model_len=12)
    s2.add_request(_req("m", 8))
    out = s2.schedule()
    s2.update_from_output(out, [[1]])
    out = s2.schedule()
    assert out.num_draft_tokens == [3]  # positions 8..11 are the last that fit
    s3, _, _ = _sched(k=5, budget=3)
    s3.add_request(_req("b", 3))
    out = s3.schedule()
    s3.update_from_output(out, [[1]])
    assert s3.schedule().num_draft_tokens == [2]


def test_prefill_chunks_and_preemption_forget_drafts():
    s, _, _ = _sched(k=2, budget=6)
    s.add_request(_req("p", 10))
    out = s.schedule()  # chunk of 6: samples nothing
    assert s.requests["p"].num_drafts_ready == 0
    s.update_from_output(out, [[]])
    out = s.schedule()  # the rest: samples
    assert out.num_scheduled_tokens == [4] and s.requests["p"].num_drafts_ready == 2
    s.update_from_output(out, [[3]])
    s._preempt(s.requests["p"])
    assert s.requests["p"].num_drafts_ready == 0
    out = s.schedule()  # resumed: recomputes prompt + output, no drafts
    assert out.num_draft_tokens == [0] and out.num_scheduled_tokens == [6]


@pytest.mark.parametrize(
    "penalty", [dict(repetition_penalty=1.2), dict(frequency_penalty=0.5), dict(presence_penalty=-0.5)]
)
def test_penalised_requests_speculate(penalty):
    """Verification rows count the drafts before them (samplers.penalties): no fallback to k = 0."""
    s, _, _ = _sched(k=2)
    s.add_request(_req("r", 4, **penalty))
    out = s.schedule()
    s.update_from_output(out, [[5]])
    assert s.schedule().num_draft_tokens == [2]


def test_stop_token_among_accepted_tokens_ends_the_request():
    s, kv, _ = _sched(k=3)
    s.add_request(Request("e", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20), eos_token_id=9))
    out = s.schedule()
    s.update_from_output(out, [[4]])
    out = s.schedule()
    finished = s.update_from_output(out, [[5, 9, 6]])
    assert [r.request_id for r in finished] == ["e"]
    assert finished[0].output_token_ids == [4, 5, 9] and finished[0].status == RequestStatus.FINISHED_STOPPED
    assert kv.num_free_blocks == kv.num_blocks
    s.check_invariants()


class _Sequence(FixedK):
    """k from a list, one per step (the last one repeated)."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(max(ks))
        self.ks = ks

    def choose(self, request_ids):
        return self.ks.pop(0) if len(self.ks) > 1 else self.ks[0]


def test_decode_rows_with_different_drafts_verify_the_fewest():
    """A row that sat out a step (its last tokens in flight) still holds the drafts of the k before; when k
    changed meanwhile, every decode row verifies the fewest drafts any row holds, so the batch stays uniform
    (CUDA graph) instead of running eagerly. A batch with a prefill chunk runs eagerly anyway: no change."""
    s, _, _ = _sched(k=5, budget=64)
    policy = _Sequence([5, 2, 2])
    s.draft_policy = policy
    s.add_request(_req("a", 4))
    s.add_request(_req("b", 4))
    out = s.schedule()  # prefills; proposals after this step: 5 drafts each
    s.update_from_output(out, [[1], [1]])
    s.requests["b"].num_drafts_ready = 2  # as if b had last been scheduled when k was 2
    out = s.schedule()
    assert out.num_draft_tokens == [2, 2] and out.num_scheduled_tokens == [3, 3]
    assert s.requests["a"].num_computed_tokens == 4 + 3  # only the verified drafts are counted
    assert s.requests["a"].num_output_placeholders == 3
    s.update_from_output(out, [[2, 3, 4], [2]])
    # A prefill row in the batch: eager anyway, rows keep their own drafts.
    s.requests["b"].num_drafts_ready = 1
    s.add_request(_req("c", 5))
    out = s.schedule()
    assert out.num_draft_tokens == [2, 1, 0] and out.num_scheduled_tokens == [3, 2, 5]
    s.check_invariants()


def test_metrics_of_a_step_equal_per_row_records():
    """`record_step` counts rows with equal (drafts, accepted) together: the same numbers as a record per row,
    rows without drafts ignored."""
    import random

    rng = random.Random(0)
    drafts = [rng.choice([0, 2, 3]) for _ in range(200)]
    accepted = [rng.randint(0, d) for d in drafts]
    per_row, per_step = SpecDecodeMetrics(), SpecDecodeMetrics()
    for d, a in zip(drafts, accepted):
        per_row.record(d, a)
    per_step.record_step(drafts, accepted)
    assert per_step.as_dict() == per_row.as_dict() and per_step.num_drafts == sum(d > 0 for d in drafts)
