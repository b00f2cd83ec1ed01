"""A step's small per-row arrays reach the device in one copy, from host buffers used in turn (framework/host_staging).

The claims:
- `build_input_batch` makes exactly one host-to-device copy (counted with patched `Tensor.copy_` / `Tensor.to`;
  the same meter counts the five copies of the old way, so it can fail), and its arrays equal the host's;
- a step's device views keep their values while the next steps are packed (the buffers rotate), and a host
  buffer is rewritten only after the fence of the copy that last read it was waited on, with that copy's data
  still in place; with one buffer (negative control) the next step's packing does overwrite them;
- in an engine with full-step graphs, every step looks up its request slots once, eager steps send one staged
  copy each and replayed steps none (their idx_mapping goes through the graphs' own ring).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
from helpers.fake_graphs import StaticInputsCapturer
from helpers.observed import counted

from framework.batch import input_batch
from framework.batch.host_staging import HostRing, InputStaging
from framework.batch.input_batch import InputBatch, build_input_batch, input_staging
from framework.batch.request_state import RequestState
from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import NewRequestData, SchedulerOutput

CPU = torch.device("cpu")
K, MAX_LEN = 2, 32


def _state(num_requests: int) -> RequestState:
    state = RequestState(8, MAX_LEN, K, CPU)
    for i in range(num_requests):
        prompt = [3 + i, 5, 7, 9 + i][: 2 + i % 3]
        state.add_request(NewRequestData(f"r{i}", prompt, len(prompt), SamplingParams(), 0, [i], 0))
    state.apply_staged_writes()
    return state


def _output(ids: list[str], num_scheduled: list[int], num_draft: list[int]) -> SchedulerOutput:
    return SchedulerOutput(ids, num_scheduled, num_draft, [], [])


def _expected(batch: InputBatch, state: RequestState, out: SchedulerOutput) -> None:
    """The staged arrays equal what the host computed (the old code's five separate copies)."""
    slots = [state.req_id_to_slot[r] for r in out.scheduled_request_ids]
    sched, drafts = np.array(out.num_scheduled_tokens), np.array(out.num_draft_tokens)
    expect = {
        "idx_mapping": slots,
        "query_start_loc": np.concatenate([[0], np.cumsum(sched)]),
        "cu_num_logits": np.concatenate([[0], np.cumsum(drafts + 1)]),
        "query_lens": sched,
        "num_draft": drafts,
    }
    for name, values in expect.items():
        got = getattr(batch, name)
        assert got.dtype == torch.int32 and got.is_contiguous(), name
        assert got.tolist() == list(values), name
        assert got.data_ptr() % 16 == 0, f"{name} view is not 16-byte aligned"


class _Counter:
    """Counts `Tensor.copy_` and `Tensor.to(device)` calls outside `prepare_inputs` (the kernel wrapper's own
    interpreter copies are not the batch's host arrays)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self.paused = 0, False
        copy_, to = torch.Tensor.copy_, torch.Tensor.to

        def counted(real: Callable[..., Any]) -> Callable[..., Any]:
            def call(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if not self.paused:
                    self.count += 1
                return real(t, *args, **kwargs)

            return call

        prepare = input_batch.prepare_inputs

        def unmetered(*args: Any, **kwargs: Any) -> Any:
            self.paused = True
            try:
                return prepare(*args, **kwargs)
            finally:
                self.paused = False

        monkeypatch.setattr(torch.Tensor, "copy_", counted(copy_))
        monkeypatch.setattr(torch.Tensor, "to", counted(to))
        monkeypatch.setattr(input_batch, "prepare_inputs", unmetered)


def test_one_copy_per_step_and_the_arrays_equal_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state(3)
    staging = input_staging(8, CPU)
    counter = _Counter(monkeypatch)
    out = _output(["r2", "r0", "r1"], [4, 2, 3], [0, 0, 0])
    batch = build_input_batch(out, state, CPU, staging)
    assert counter.count == 1 and staging.copies == 1
    _expected(batch, state, out)

    counter.count = 0  # the meter's negative control: the old way's five separate copies
    for a in (np.arange(3), np.arange(4), np.arange(4), np.ones(3), np.zeros(3)):
        torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(CPU, non_blocking=True)
    assert counter.count == 5


class _FakeFence:
    """Stands in for a CUDA event: remembers the host buffer it guards and what it held when recorded."""

    def __init__(self, log: list[tuple[str, Any]], ring: list[HostRing]) -> None:
        self.log, self.ring = log, ring

    def record(self) -> None:
        i = (self.ring[0].turn - 1) % len(self.ring[0].buffers)
        self.index, self.held = i, self.ring[0].buffers[i].clone()
        self.log.append(("record", i))

    def synchronize(self) -> None:  # the data of the copy it fences must still be there: not yet overwritten
        assert torch.equal(self.ring[0].buffers[self.index], self.held), "buffer rewritten before its copy finished"
        self.log.append(("wait", self.index))


def test_views_survive_the_next_steps_and_buffers_are_reused_after_their_fence() -> None:
    state = _state(4)
    log: list[tuple[str, Any]] = []
    ring: list[HostRing] = []
    staging = InputStaging(
        InputStaging.capacity_for(8, input_batch.NUM_STAGED_PIECES), CPU, make_fence=lambda: _FakeFence(log, ring)
    )
    ring.append(staging.ring)
    steps = [
        _output(["r0", "r1"], [3, 1], [0, 0]),
        _output(["r3", "r2", "r1", "r0"], [1, 1, 2, 1], [0, 0, 1, 0]),
        _output(["r2"], [2], [1]),
        _output(["r1", "r3"], [1, 3], [0, 2]),
    ]
    batches = []
    for i, out in enumerate(steps):
        batches.append(build_input_batch(out, state, CPU, staging))
        for earlier in range(max(0, i - 2), i + 1):  # the two steps before stay intact while this one is packed
            _expected(batches[earlier], state, steps[earlier])
    assert len({b.idx_mapping.data_ptr() for b in batches[:3]}) == 3, "three steps in flight share a buffer"
    assert batches[3].idx_mapping.data_ptr() == batches[0].idx_mapping.data_ptr()  # the ring came round
    assert log == [("record", 0), ("record", 1), ("record", 2), ("wait", 0), ("record", 0)]


def test_one_buffer_is_overwritten_by_the_next_step() -> None:
    """Negative control for the rotation: with a single buffer the previous step's views change."""
    state = _state(3)
    staging = input_staging(8, CPU, num_buffers=1)
    first = _output(["r0", "r1", "r2"], [2, 2, 2], [0, 0, 0])
    batch = build_input_batch(first, state, CPU, staging)
    build_input_batch(_output(["r2"], [1], [0]), state, CPU, staging)
    with pytest.raises(AssertionError):
        _expected(batch, state, first)


def test_a_step_larger_than_the_staging_is_refused() -> None:
    state = _state(5)  # 5 rows; staging for 1 row (rounded up to 4 elements a piece)
    with pytest.raises(ValueError, match="input staging holds 20 int32 elements"):
        build_input_batch(_output([f"r{i}" for i in range(5)], [1] * 5, [0] * 5), state, CPU, input_staging(1, CPU))


@pytest.mark.usefixtures("one_thread")
def test_engine_steps_look_up_slots_once_and_send_one_staged_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(
        "tiny", device="cpu", dtype="float32", seed=0, max_num_seqs=4, max_model_len=64, full_step_cuda_graphs=True
    )
    runner = llm.engine.runner
    runner.capture_cuda_graphs(StaticInputsCapturer())
    assert runner.graphs.step_graphs is not None
    counts = counted(llm)
    from framework.runner import model_runner

    lookups = []
    lookup = model_runner.batch_req_slots
    monkeypatch.setattr(model_runner, "batch_req_slots", lambda *a: (lookups.append(1), lookup(*a))[1])
    monkeypatch.setattr(input_batch, "batch_req_slots", lambda *a: pytest.fail("slots looked up a second time"))
    steps = 0
    engine = llm.engine
    for i, params in enumerate(
        [
            SamplingParams(max_tokens=6, ignore_eos=True),
            SamplingParams(max_tokens=5, ignore_eos=True, bad_words=["zz"]),  # its steps fall back
            SamplingParams(max_tokens=7, ignore_eos=True),
        ]
    ):
        engine.add_request(f"r{i}", [5 + i, 9, 11], params)
    while engine.has_unfinished_requests() and steps < 50:
        engine.step()
        steps += 1
    eager = len(lookups) - counts.full_step_replays
    assert counts.full_step_replays > 0 and counts.full_step_fallbacks["bad_words"] > 0
    assert runner.input_staging.copies == eager > 0  # one staged copy per step that built an InputBatch
    assert runner.graphs.step_graphs._host_idx.turn == counts.full_step_replays  # one idx_mapping copy per replay
