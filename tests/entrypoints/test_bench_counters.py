"""`BenchCounters`, the bench's `StepObserver`: every hook reaches it, the counts match what the graphs themselves
recorded, and a detached observer sees nothing. A hook the engine or the runner stops calling fails here."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.fake_graphs import StaticInputsCapturer

from framework.entrypoints.bench.counters import BenchCounters
from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import SchedulerOutput
from framework.runner.observer import NO_OBSERVER, StepObserver

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = {"device": "cpu", "dtype": "float32", "seed": 0, "max_num_seqs": 4, "max_model_len": 64}
PROMPTS = [[5 + i, 9, 11, 3 * i + 1] for i in range(3)]


def _params(**kwargs: Any) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True, **kwargs) for i in range(3)]


def _llm(**kwargs: Any) -> LLM:
    llm = LLM("tiny", **{**BASE, **kwargs})
    llm.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
    return llm


def test_an_engine_nobody_observes_holds_the_no_op_observer() -> None:
    llm = LLM("tiny", **BASE)
    assert llm.engine.observer is NO_OBSERVER and llm.engine.runner.observer is NO_OBSERVER
    assert type(NO_OBSERVER) is StepObserver  # its hooks do nothing
    NO_OBSERVER.on_step(SchedulerOutput([], [], [], [], []))
    NO_OBSERVER.on_full_step_fallback("any")


def test_full_step_hooks_count_what_the_graphs_replayed() -> None:
    llm = _llm(full_step_cuda_graphs=True, prefill_cuda_graphs=False)
    counters = BenchCounters()
    llm.engine.set_observer(counters)
    assert llm.engine.runner.observer is counters  # passed down to the runner's graphs
    llm.generate(PROMPTS, _params(), use_tqdm=False)
    graphs = llm.engine.runner.graphs.step_graphs
    assert graphs is not None
    replayed = sum(g.num_replays for g in graphs.graphs.values())
    assert counters.full_step_replays == replayed > 5
    # the prompt steps could not replay: each one is a fallback, and every step was seen
    assert counters.full_step_fallbacks["not pure decode"] > 0
    assert counters.steps_run >= counters.full_step_replays + counters.full_step_fallbacks.total()
    assert counters.prefill_piece_steps == 0  # prefill pieces are off

    llm.engine.set_observer(None)  # detached: the counts stay
    before = (counters.steps_run, counters.full_step_replays, dict(counters.full_step_fallbacks))
    llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert (counters.steps_run, counters.full_step_replays, dict(counters.full_step_fallbacks)) == before
    assert llm.engine.runner.observer is NO_OBSERVER


def test_a_fallback_reason_reaches_the_observer() -> None:
    llm = _llm(full_step_cuda_graphs=True)
    counters = BenchCounters()
    llm.engine.set_observer(counters)
    llm.generate(PROMPTS, _params(bad_words=[[7, 9]]), use_tqdm=False)  # bad_words rows cannot replay whole
    assert counters.full_step_fallbacks["bad_words"] > 0 and counters.full_step_replays == 0


def test_prefill_piece_steps_count_what_the_pieces_replayed() -> None:
    llm = _llm(
        full_step_cuda_graphs=False,
        prefill_cuda_graphs=True,
        prefill_cuda_graph_sizes=[8, 16],
        max_num_batched_tokens=16,
    )
    counters = BenchCounters(keep_steps=True)
    llm.engine.set_observer(counters)
    llm.generate(PROMPTS, _params(), use_tqdm=False)
    pieces = llm.engine.runner.graphs.prefill_graphs
    assert pieces is not None
    assert counters.prefill_piece_steps == pieces.num_replayed_steps > 0
    assert counters.steps is not None and len(counters.steps) == counters.steps_run
    assert counters.full_step_replays == 0 and not counters.full_step_fallbacks  # full-step graphs are off
