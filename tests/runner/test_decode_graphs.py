"""Decode CUDA graphs for model states with per-slot inputs, on the CPU: the "static inputs + replay" path.

A CPU has no CUDA graphs, so `EagerReplayCapturer` (tests/helpers/fake_graphs.py) "replays" by running the captured
step again on the graphs' static buffers. That drives everything a GPU replay depends on: the static buffers
and their padding rows, the dummy slot, `prepare_graph_inputs` built from the static idx_mapping, and the
state's `prepare_graph_step` / `postprocess` around the replay. The claims:

- the padding logic of `DecodeCudaGraphs` (sizes, padding rows' positions, KV lengths, KV slots, slots);
- Mamba hybrid: graph replay equals eager, token for token and in every real slot's conv and SSM state after
  every step, with requests joining and leaving, preemption, ngram drafts (state advances by accepted tokens)
  and prefix-caching snapshots (copied outside the graph: the snapshot pools equal the in-kernel ones);
  negative control: padding rows pointed at a real slot instead of the dummy slot fail the comparison;
- Whisper: graph replay gives HF's tokens (cross-attention reads the paged cross cache inside the graph);
- the interface for third-party states: a state declares why it cannot be captured and the runner logs it;
  the example plugin's steering state builds its graph inputs from the static buffers.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.fake_graphs import EagerReplayCapturer
from helpers.graph_lockstep import (
    check_exercised,
    hybrid_scenarios,
    lockstep,
    record_preemptions,
    record_replays,
    record_snapshot_copies,
    workload,
)

from framework.batch.graph_batch import GraphBatch
from framework.entrypoints.llm import LLM
from framework.layers.attention import AttentionMetadata
from framework.params.sampling_params import SamplingParams
from framework.runner.graphs.cuda_graphs import DecodeCudaGraphs
from model_states.default import DefaultModelState

REPO = Path(__file__).resolve().parents[2]


# The tiny models' many tiny ops run faster on one thread of a small shared CPU (conftest's `one_thread`).
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- DecodeCudaGraphs: shapes and padding ------------------------------------------------------------------


def test_static_buffers_and_padding_rows() -> None:
    seen: list[dict[str, Any]] = []

    def forward(ids, pos, kv, meta, **extra):  # type: ignore[no-untyped-def]
        seen.append(
            {
                "ids": ids.clone(),
                "pos": pos.clone(),
                "seq": meta.seq_lens.clone(),
                "kv": meta.kv_slot_mapping.clone(),
                "tables": meta.block_tables.clone(),
                **extra,
            }
        )
        return ids * 10

    def graph_inputs(g: GraphBatch) -> dict[str, Any]:
        return {"slots": g.idx_mapping.clone(), "rows": g.token_rows.clone(), "qsl": g.query_start_loc.clone()}

    capturer = EagerReplayCapturer()
    graphs = DecodeCudaGraphs(
        forward,
        [],
        [2, 4],
        3,
        16,
        64,
        torch.device("cpu"),
        tokens_per_row=(1, 3),
        graph_inputs=graph_inputs,
        dummy_slot=9,
        capturer=capturer,
    )
    graphs.capture()
    assert sorted(graphs.graphs) == [(2, 1), (2, 3), (4, 1), (4, 3)]
    assert all((s["slots"] == 9).all() for s in seen)  # warm-up touches only the dummy slot
    assert [graphs.padded_size(r, q) for r, q in ((1, 1), (2, 1), (3, 1), (4, 3), (5, 1), (2, 2))] == [
        2,
        2,
        4,
        4,
        None,
        None,
    ]
    seen.clear()
    r, q = 3, 3
    meta = AttentionMetadata(
        num_tokens=r * q,
        num_rows=r,
        query_start_loc=torch.arange(r + 1, dtype=torch.int32) * q,
        seq_lens=torch.tensor([7, 20, 5], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]], dtype=torch.int32),
        kv_slot_mapping=torch.arange(100, 100 + r * q),
        block_size=16,
        max_query_len=q,
        max_seq_len=20,
    )
    ids = torch.arange(1, r * q + 1)
    out = graphs.run(4, ids, torch.arange(r * q) + 4, meta, idx_mapping=torch.tensor([5, 0, 2], dtype=torch.int32))
    assert torch.equal(out, ids * 10)  # only the real tokens come back
    s = seen[-1]
    assert s["pos"][r * q :].tolist() == [0, 1, 2]  # the padding row: a valid causal row of q tokens
    assert s["seq"].tolist() == [7, 20, 5, 3] and s["kv"][r * q :].tolist() == [-1, -1, -1]  # stores skipped
    assert s["tables"][r:].eq(0).all() and s["slots"].tolist() == [5, 0, 2, 9]
    assert s["rows"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3] and s["qsl"].tolist() == [0, 3, 6, 9, 12]
    with pytest.raises(ValueError, match="idx_mapping"):
        graphs.run(4, ids, ids, meta)


# ---- Mamba hybrid: replay equals eager, step by step -------------------------------------------------------

HYBRID = {
    "device": "cpu",
    "dtype": "float32",
    "seed": 0,
    "max_num_seqs": 6,
    "max_model_len": 64,
    "async_scheduling": True,
}
SCENARIOS = hybrid_scenarios(block_size=4)


def _hybrid(with_graphs: bool, **kwargs: Any) -> LLM:
    llm = LLM("jamba-tiny", **{**HYBRID, **kwargs})
    if with_graphs:
        llm.engine.runner.capture_cuda_graphs(EagerReplayCapturer())
    return llm


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_hybrid_graph_replay_equals_eager(scenario: str) -> None:
    eager, graphed = _hybrid(False, **SCENARIOS[scenario]), _hybrid(True, **SCENARIOS[scenario])
    replays, snapshots = record_replays(graphed), record_snapshot_copies(graphed)
    preempted = record_preemptions(graphed)
    tokens = lockstep(eager, graphed, workload(scenario))
    check_exercised(scenario, eager, graphed, tokens, replays, snapshots, preempted)


def test_padding_rows_on_a_real_slot_are_caught() -> None:
    """Negative control: padding rows that write slot 0 (a live request's) instead of the dummy slot."""
    eager, graphed = _hybrid(False), _hybrid(True)
    graphed.engine.runner.graphs.cuda_graphs.dummy_slot = 0
    with pytest.raises(AssertionError, match="Tensor-likes are not close|tokens differ"):
        lockstep(eager, graphed, workload("join_leave"))


def test_hybrid_states_keep_a_dummy_slot_no_request_owns() -> None:
    llm = _hybrid(True)
    state = llm.engine.runner.model_state
    assert state.graph_dummy_slot == state.max_num_reqs == 6
    assert state.conv_state.shape[1] == state.ssm_state.shape[1] == 7
    assert state.graph_dummy_slot not in llm.engine.runner.request_state.free_slots
    assert state.cuda_graph_unsupported_reason() is None


# ---- Whisper -----------------------------------------------------------------------------------------------


def test_whisper_graph_replay_equals_hf(tmp_path: Path) -> None:
    """Requests joining and leaving (4 slots, 6 requests of different lengths), padding rows, a preemption (the
    resumed request is encoded again); the dummy slot's cross K/V is never written."""
    import helpers.whisper_models as wm

    hf = wm.save_tiny_whisper(tmp_path, seed=2)
    audio = [wm.synthetic_audio(s, seed=i) for i, s in enumerate([0.2, 0.5, 0.8, 1.0, 0.3, 0.6])]
    lengths = (24, 9, 17, 5, 24, 12)
    llm = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        seed=0,
        max_model_len=40,
        max_num_seqs=4,
        block_size=16,
        num_kv_blocks=5,
    )
    llm.engine.runner.capture_cuda_graphs(EagerReplayCapturer())
    replays, preempted = record_replays(llm), record_preemptions(llm)
    outs = llm.generate(
        [{"audio": (a, wm.SAMPLING_RATE)} for a in audio],
        [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths],
        use_tqdm=False,
    )
    for a, n, out in zip(audio, lengths, outs):
        got = list(out.token_ids)
        assert (got[:-1] if got and got[-1] == wm.EOS_ID else got) == wm.hf_transcribe(hf, wm.hf_features(a), n)
    assert any(rows < size for rows, size, _ in replays), "no replay had padding rows"
    state = llm.engine.runner.model_state
    assert preempted and state.num_encoder_runs > len(audio)
    assert not state.cross_kv[:, :, state.graph_dummy_slot * state.blocks_per_slot :].any()


# ---- the interface for third-party states ------------------------------------------------------------------


class _ExtraInputsState(DefaultModelState):
    name = "extra-inputs-test"

    def prepare_inputs(self, batch):  # type: ignore[no-untyped-def]
        return {"extra": batch.idx_mapping}


class _OptedOutState(DefaultModelState):
    name = "opted-out-test"
    decode_cuda_graphs = False


def test_states_say_why_they_cannot_be_captured_and_the_runner_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    assert DefaultModelState(None, {}, 2, cpu).cuda_graph_unsupported_reason() is None  # type: ignore[arg-type]
    reason = _ExtraInputsState(None, {}, 2, cpu).cuda_graph_unsupported_reason()  # type: ignore[arg-type]
    assert reason is not None and "prepare_graph_inputs" in reason and "extra-inputs-test" in reason
    assert "decode_cuda_graphs = False" in _OptedOutState(None, {}, 2, cpu).cuda_graph_unsupported_reason()  # type: ignore[arg-type,operator]
    llm = LLM("tiny", device="cpu", max_num_seqs=2, max_model_len=32)
    runner = llm.engine.runner
    runner.model_state = _OptedOutState(runner.model, {}, 2, cpu)
    with caplog.at_level(logging.INFO, logger="framework.runner.model_runner"):
        runner.capture_cuda_graphs(EagerReplayCapturer())
    assert runner.graphs.cuda_graphs is None
    assert (
        "decode runs without CUDA graphs: model state 'opted-out-test' sets decode_cuda_graphs = False" in caplog.text
    )


def test_steering_example_state_builds_its_graph_inputs_from_the_static_buffers() -> None:
    """The example plugin's state: padded graph inputs equal its eager inputs on the real rows, and padding
    rows read the dummy slot (scale 0). Imported from its source tree: nothing is registered."""
    sys.path.insert(0, str(REPO / "examples" / "mrv2-example-plugin"))
    try:
        from mrv2_example_plugin.steering import SteeringModelState
    finally:
        sys.path.pop(0)
    state = SteeringModelState(None, {"vocab_size": 50}, 3, torch.device("cpu"))
    assert state.cuda_graph_unsupported_reason() is None
    for slot, (token, scale) in enumerate([(4, 1.5), (9, 0.0), (17, 2.0)]):
        params = SimpleNamespace(extra_args={"steering": {"token_id": token, "scale": scale}})
        state.add_request(slot, SimpleNamespace(sampling_params=params))
    state.apply_staged_writes()
    idx = torch.tensor([2, 0], dtype=torch.int32)
    rows = torch.tensor([0, 0, 1, 1])  # two rows of two tokens
    eager = state.prepare_inputs(SimpleNamespace(idx_mapping=idx, token_rows=rows))
    padded = torch.cat([idx, torch.tensor([state.graph_dummy_slot], dtype=torch.int32)])
    graph = state.prepare_graph_inputs(
        GraphBatch(3, 2, padded, torch.arange(4, dtype=torch.int32) * 2, torch.arange(6) // 2)
    )
    for name in ("steer_token_ids", "steer_scales"):
        assert torch.equal(graph[name][:4], eager[name])
    assert graph["steer_scales"][4:].eq(0).all()
    assert eager["steer_token_ids"].tolist() == [17, 17, 4, 4]
