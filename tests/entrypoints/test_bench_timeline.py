"""`bench.step_timeline`: the steps the bench's observer keeps, the per-step records built from them, and their
grouping."""

from types import SimpleNamespace

import pytest

from framework import SamplingParams
from framework.entrypoints.bench.counters import BenchCounters
from framework.entrypoints.bench.timeline import (
    DENSE_FLOPS,
    HBM_BYTES_PER_S,
    StepRecord,
    format_groups,
    group_steps,
    stop_recording,
)
from framework.params.scheduler_output import SchedulerOutput


def test_the_observer_keeps_every_executed_step(tiny_llm_factory):
    llm = tiny_llm_factory()
    prompts = [[5, 6, 7], [8] * 11, [9, 10]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 6, 1)]
    counting = BenchCounters()  # counts, keeps no steps
    llm.engine.set_observer(counting)
    llm.generate(prompts, params, use_tqdm=False)
    assert counting.steps is None and counting.steps_run > 0
    kept = BenchCounters(keep_steps=True)
    llm.engine.set_observer(kept)
    llm.generate(prompts, params, use_tqdm=False)
    llm.engine.set_observer(None)
    llm.generate(prompts, params, use_tqdm=False)  # detached: seen by no one
    log = kept.steps
    assert log is not None and len(log) == kept.steps_run
    scheduled = sum(sum(out.num_scheduled_tokens) for out in log)
    # Every prompt token and every output token but the last of each request is fed to a forward exactly once.
    assert scheduled == sum(map(len, prompts)) + sum(p.max_tokens - 1 for p in params)
    assert all(isinstance(out, SchedulerOutput) and out.scheduled_request_ids for out in log)


class _Event:
    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: "_Event") -> float:
        return end.ms - self.ms

    def synchronize(self) -> None:
        pass


def _output(rows: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(list(rows), list(rows.values()), [0] * len(rows), [], [])


def test_records_count_each_rows_context_and_the_device_time():
    outputs = [_output({"a": 10}), _output({"a": 1, "b": 7}), _output({"a": 1, "b": 1})]
    events = [(_Event(0.0), _Event(2.5)), (_Event(3.0), _Event(4.0)), (_Event(4.0), _Event(4.25))]
    counters = BenchCounters(keep_steps=True)
    counters.steps = outputs
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(step_events=events)))
    records = stop_recording(llm, counters)
    assert records == [
        StepRecord(rows=1, decode_rows=0, prompt_tokens=10, keys_read=10, device_ms=2.5),
        StepRecord(rows=2, decode_rows=1, prompt_tokens=7, keys_read=11 + 7, device_ms=1.0),
        StepRecord(rows=2, decode_rows=2, prompt_tokens=0, keys_read=12 + 8, device_ms=0.25),
    ]
    assert counters.steps is None and llm.engine.runner.step_events is None  # recording stopped


def test_groups_sum_device_time_and_the_bytes_floor_by_kind_of_step():
    records = [
        StepRecord(3, 1, 100, 300, 2.0),
        StepRecord(200, 200, 0, 50_000, 4.0),
        StepRecord(2, 2, 0, 400, 1.0),
        StepRecord(3, 3, 0, 500, 1.5),
        StepRecord(5, 5, 0, 900, 1.0),
    ]
    weights, params, per_token = 10**9, 5 * 10**9, 1000
    groups = {g.name: g for g in group_steps(records, weights, params, per_token)}
    assert list(groups) == ["with prompt tokens", "decode, 129+ rows", "decode, 1-4 rows", "decode, 5-16 rows"]
    small = groups["decode, 1-4 rows"]
    assert small.steps == 2 and small.device_s == pytest.approx(2.5e-3)
    assert small.floor_s == pytest.approx((2 * weights + 900 * per_token) / HBM_BYTES_PER_S)
    # 101 tokens through 5e9 parameters take longer in FLOPs than the weights' bytes take to stream
    assert groups["with prompt tokens"].floor_s == pytest.approx(2 * params * 101 / DENSE_FLOPS)
    table = format_groups(list(groups.values()), wall_s=0.02)
    assert "| all | 5 | 0.010 |" in table and "device idle 0.010 s" in table
