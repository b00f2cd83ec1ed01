"""The threaded grammar-bitmask fill: the same masks as one matcher at a time, errors reach the caller, and a
batch without a constrained row starts nothing."""

from __future__ import annotations

import llguidance
import numpy as np
import pytest
import torch

from framework import SamplingParams, StructuredOutputsParams
from framework.config.schema import load_config
from framework.entrypoints.llm import LLM
from framework.models.tokenizer import ByteTokenizer
from framework.params.scheduler_output import NewRequestData
from samplers.structured.backend import GuidanceBackend
from samplers.structured.bitmask import bitmask_words
from samplers.structured.fill import BitmaskFiller, FillJob
from samplers.structured.state import StructuredOutputsState

VOCAB, EOS = 300, 256
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 5},
        },
        "required": ["id", "name"],
        "additionalProperties": False,
    },
}
TEXT = b'[{"id":12,"name":"abc"},{"id":7,"name":"xy"}]'


def _matchers(n: int) -> tuple[GuidanceBackend, str, list[llguidance.LLMatcher], list[int]]:
    """n matchers of SCHEMA, matcher i advanced over the first (3 * i) % len(TEXT) bytes of TEXT."""
    backend = GuidanceBackend(ByteTokenizer(), VOCAB, EOS)
    grammar = backend.check(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    matchers, offsets = [], []
    for i in range(n):
        m = llguidance.LLMatcher(backend.lltokenizer, grammar, log_level=0)
        offsets.append((3 * i) % (len(TEXT) - 4))
        assert all(m.consume_token(b) for b in TEXT[: offsets[-1]])
        matchers.append(m)
    return backend, grammar, matchers, offsets


def _reference(backend: GuidanceBackend, grammar: str, tokens: bytes) -> list[int]:
    """The mask words after `tokens`, from a fresh matcher (no threads, no drafts)."""
    m = llguidance.LLMatcher(backend.lltokenizer, grammar, log_level=0)
    assert all(m.consume_token(b) for b in tokens)
    return np.frombuffer(m.compute_bitmask(), dtype=np.int32).tolist()


@pytest.mark.parametrize("num_threads", [0, 1, 3])
def test_threaded_fill_matches_one_matcher_at_a_time(num_threads: int) -> None:
    backend, grammar, matchers, offsets = _matchers(23)
    words = bitmask_words(VOCAB)
    jobs, expected, row = [], [], 0
    for i, (m, off) in enumerate(zip(matchers, offsets)):
        drafts = list(TEXT[off : off + i % 3])  # 0, 1 or 2 drafts, all valid (the walk's next bytes)
        jobs.append(FillJob(m, row, drafts))
        expected += [_reference(backend, grammar, TEXT[: off + j]) for j in range(len(drafts) + 1)]
        row += len(drafts) + 1
    mask = torch.zeros(row + 2, words, dtype=torch.int32)  # two spare rows: nothing writes them
    filler = BitmaskFiller(num_threads, workers_from_mask_s=0)  # the workers fill, however cheap the masks
    assert filler.uses_workers == (num_threads > 0)
    for _ in range(2):  # twice: the second fill sees the matchers rolled back from the drafts
        mask.zero_()
        filler.start(jobs, mask.data_ptr(), 4 * words)
        timing = filler.join()
        assert timing is not None and timing.fill_s >= 0 and timing.exposed_s >= 0
        assert mask[:row].tolist() == expected
        assert not mask[row:].any()
    assert filler.join() is None  # nothing in flight


def test_fill_error_reaches_join_and_the_filler_recovers() -> None:
    _, _, matchers, _ = _matchers(9)
    words = bitmask_words(VOCAB)
    mask = torch.zeros(9, words, dtype=torch.int32)
    filler = BitmaskFiller(2, workers_from_mask_s=0)
    filler.start([FillJob(m, i, []) for i, m in enumerate(matchers)], mask.data_ptr(), 4 * words + 4)
    with pytest.raises(ValueError, match="Invalid buffer size"):
        filler.join()
    filler.start([FillJob(m, i, []) for i, m in enumerate(matchers)], mask.data_ptr(), 4 * words)
    filler.join()
    assert mask.any(dim=1).all()  # every row written


def test_workers_take_a_step_only_once_masks_are_measured_dear() -> None:
    """The first step is filled by the joining thread (its cost is measured there); the workers take the next
    steps only while the running cost per mask reaches the threshold: a threshold below any mask's cost hands
    the second step to them, one above every mask's cost never does."""
    _, _, matchers, _ = _matchers(8)
    words = bitmask_words(VOCAB)
    mask = torch.zeros(8, words, dtype=torch.int32)
    jobs = [FillJob(m, i, []) for i, m in enumerate(matchers)]
    for threshold, expect_workers in ((1e-12, True), (10.0, False)):
        filler = BitmaskFiller(2, workers_from_mask_s=threshold)
        assert not filler.uses_workers and filler.mask_cost_s is None  # nothing measured yet
        for _ in range(3):
            filler.start(jobs, mask.data_ptr(), 4 * words)
            filler.join()
            assert filler.mask_cost_s is not None and filler.mask_cost_s > 0
            assert filler.uses_workers == expect_workers
    assert not BitmaskFiller(0, workers_from_mask_s=0).uses_workers  # no workers to use


def test_negative_fill_threads_refused() -> None:
    with pytest.raises(ValueError, match="fill_threads must be >= 0"):
        BitmaskFiller(-1)


def test_unconstrained_rows_start_no_fill() -> None:
    backend = GuidanceBackend(ByteTokenizer(), VOCAB, EOS)
    state = StructuredOutputsState(3, 3, VOCAB, backend, torch.device("cpu"), next_output=lambda: 0, fill_threads=2)
    free = NewRequestData("free", [1], 1, SamplingParams(), 0, [], 0)
    state.add_request(0, free)
    assert state._filler is None  # no constrained request yet: no threads, no buffers
    so = StructuredOutputsParams(regex="a+b")
    state.add_request(1, NewRequestData("r", [1], 1, SamplingParams(structured_outputs=so), 0, [], 0))
    state.fill_timings = []
    state.prepare(np.array([0]), np.array([0]), [[]])  # only the unconstrained slot is in the batch
    assert state.step_masks() is None and state.fill_timings == []
    logits = torch.randn(1, VOCAB)
    assert torch.equal(state.apply(logits.clone()), logits)
    state.prepare(np.array([0, 1]), np.array([0, 1]), [[], []])  # control: a constrained row is filled
    masks, rows = state.step_masks()  # type: ignore[misc]
    assert rows.tolist() == [1] and len(state.fill_timings) == 1


def test_engine_unconstrained_batches_fill_nothing() -> None:
    config = load_config(
        {"model": {"preset": "random_tiny"}, "device": "cpu", "sampler": {"structured_outputs_fill_threads": 1}}
    )
    llm = LLM(config=config)
    state = llm.engine.runner.sampling_states.structured
    assert state.fill_threads == 1
    state.fill_timings = []
    free = [SamplingParams(max_tokens=6, ignore_eos=True, seed=i) for i in range(3)]
    llm.generate([[1, 2, 3]] * 3, free, use_tqdm=False)
    assert state.fill_timings == [] and state._filler is None
    so = StructuredOutputsParams(choice=["yes", "no"])  # control: the same run with one constrained request
    out = llm.generate(
        [[1, 2, 3]] * 3, free[:2] + [SamplingParams(max_tokens=6, structured_outputs=so)], use_tqdm=False
    )
    assert out[2].text in ("yes", "no") and len(state.fill_timings) >= 2
