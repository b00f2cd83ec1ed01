"""Prefill graph pieces (framework/runner/graphs/prefill_graphs.py) on the CPU: the "static inputs + replay" path.

`StaticInputsCapturer` (tests/helpers/fake_graphs.py) "replays" a piece by running it again and fails when it reads a
storage it did not read at capture or reads device data on the host, which is what a real CUDA graph could not
do. The claims:

- the pieces with eager attention between them give the eager forward's hidden states, with padding tokens,
  and store the same K/V (padding tokens store nothing);
- an engine with the pieces on gives the same tokens and logprobs as one without, step by step, over staggered
  arrivals whose prompt steps mix prefill chunks with decode rows and need padding (prompt logprobs too), and the
  pieces did run;
- embeddings pooled from the pieces' hidden states equal eager ones;
- ngram drafting (model-free) runs with the pieces, token for token as without;
- runs the pieces cannot serve (MoE layers, draft models) say why and run eagerly, and so does one whose capture
  runs out of device memory.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from helpers.fake_graphs import StaticInputsCapturer
from helpers.graph_lockstep import run_in_lockstep
from helpers.observed import counted

from framework.config.schema import load_config
from framework.entrypoints.llm import LLM
from framework.layers.attention import AttentionMetadata
from framework.params.sampling_params import SamplingParams
from framework.runner.graphs.prefill_graphs import PrefillPieceGraphs, prefill_graph_sizes, unsupported_reason

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = {
    "device": "cpu",
    "dtype": "float32",
    "seed": 0,
    "max_num_seqs": 6,
    "max_model_len": 64,
    "max_num_batched_tokens": 24,
    "async_scheduling": True,
}
SIZES = [4, 8, 16]  # + max_num_batched_tokens (24)


def _llm(prefill_graphs: bool, model: str = "tiny", **kwargs: Any) -> LLM:
    llm = LLM(model, **{**BASE, "prefill_cuda_graphs": prefill_graphs, "prefill_cuda_graph_sizes": SIZES, **kwargs})
    llm.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
    counted(llm)  # the observer counts the replayed steps from the first step on
    return llm


def test_sizes_cover_the_step_budget() -> None:
    assert prefill_graph_sizes([512, 1024, 8192, 16384], 8192) == [512, 1024, 8192]
    assert prefill_graph_sizes([512, 1024], 3000) == [512, 1024, 3000]
    with pytest.raises(ValueError, match="prefill_cuda_graph_sizes"):
        load_config({"runner": {"prefill_cuda_graph_sizes": [0, 8]}})


def _prompt_step(llm: LLM, lengths: list[int]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Attention metadata, input ids and positions of one step that prefills rows of `lengths` tokens."""
    runner = llm.engine.runner
    block_size = runner.block_tables.block_size
    tables, slots, ids, positions, starts, blocks = [], [], [], [], [0], 0
    for n in lengths:
        need = -(-n // block_size)
        row = list(range(blocks, blocks + need))
        blocks += need
        tables.append(row)
        slots += [row[p // block_size] * block_size + p % block_size for p in range(n)]
        ids += torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        positions += list(range(n))
        starts.append(starts[-1] + n)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        num_tokens=starts[-1],
        num_rows=len(lengths),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        kv_slot_mapping=torch.tensor(slots),
        block_size=block_size,
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
    )
    return meta, torch.tensor(ids), torch.tensor(positions)


@torch.inference_mode()
def test_pieces_equal_the_eager_forward_and_padding_stores_nothing() -> None:
    llm = _llm(False)
    runner = llm.engine.runner
    model = runner.model
    meta, ids, positions = _prompt_step(llm, [5, 3, 2])  # 10 tokens: padded to 16
    eager_caches = [torch.zeros_like(c) for c in runner.kv_caches]
    expected = model(ids, positions, eager_caches, meta)
    piece_caches = [torch.zeros_like(c) for c in runner.kv_caches]
    graphs = PrefillPieceGraphs(model, piece_caches, [8, 16], torch.device("cpu"), StaticInputsCapturer())
    graphs.capture()
    for cache in piece_caches:  # warm-up and capture stored nothing (KV slots -1)
        assert not cache.any()
    size = graphs.padded_size(meta.num_tokens)
    assert size == 16 and graphs.padded_size(17) is None
    got = graphs.run(size, ids, positions, meta)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for piece, eager in zip(piece_caches, eager_caches):  # the same K/V at the real slots, nothing elsewhere
        torch.testing.assert_close(piece, eager, rtol=1e-5, atol=1e-5)
    # Once more with fewer tokens on the same pieces: the first step's KV slots left in the static buffer must
    # not make the padding tokens overwrite its K/V, and nothing of it leaks into the hidden states.
    meta2, ids2, positions2 = _prompt_step(llm, [7])
    torch.testing.assert_close(
        graphs.run(8, ids2, positions2, meta2), model(ids2, positions2, eager_caches, meta2), rtol=1e-5, atol=1e-5
    )
    for piece, eager in zip(piece_caches, eager_caches):
        torch.testing.assert_close(piece, eager, rtol=1e-5, atol=1e-5)
    assert graphs.num_replayed_steps == 2


def _work() -> list[tuple[int, list[int], SamplingParams]]:
    """Staggered arrivals with prompts of 3-30 tokens (longer than the step budget: chunked), greedy and seeded
    rows, some asking for logprobs."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(8):
        prompt = torch.randint(0, 250, (int(torch.randint(3, 31, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            max_tokens=int(torch.randint(3, 10, (1,), generator=g)),
            ignore_eos=True,
            logprobs=2 if i % 3 == 0 else None,
            prompt_logprobs=1 if i % 4 == 1 else None,
        )
        out.append((i if i < 4 else 2 * i, prompt, params))
    return out


def test_engine_with_pieces_equals_eager_step_by_step() -> None:
    off, on = _llm(False), _llm(True)
    graphs = on.engine.runner.graphs.prefill_graphs
    assert graphs is not None and off.engine.runner.graphs.prefill_graphs is None
    assert graphs.sizes == [4, 8, 16, 24]
    assert all(len(p) == len(graphs.layers) + 1 for p in graphs.pieces.values())
    padded: list[tuple[int, int]] = []
    run = graphs.run

    def recorded(size, input_ids, positions, meta):  # type: ignore[no-untyped-def]
        padded.append((meta.num_tokens, size))
        return run(size, input_ids, positions, meta)

    graphs.run = recorded  # type: ignore[method-assign]

    with_prompt_logprobs: set[str] = set()

    def check(step: int, outs_off: list, outs_on: list) -> None:
        with_prompt_logprobs.update(o.request_id for o in outs_on if o.prompt_logprobs)
        for key in ("token_ids", "logprobs", "prompt_logprobs"):
            a = {o.request_id: _plain(getattr(o, key)) for o in outs_off}
            b = {o.request_id: _plain(getattr(o, key)) for o in outs_on}
            assert a == b, f"step {step}: {key} differ"

    tokens = run_in_lockstep(off, on, _work(), check)
    assert len(tokens) == 8 and len(with_prompt_logprobs) == 2  # requests 1 and 5
    assert len(padded) >= 4, "the prompt steps did not replay the pieces"
    assert counted(on).prefill_piece_steps == len(padded) and counted(off).prefill_piece_steps == 0
    assert any(t < size for t, size in padded), "no step needed padding"
    assert any(t > 16 for t, _ in padded), "no step filled the budget"


def _plain(value: Any) -> Any:
    """Token ids, or logprob entries as (token, rounded logprob, rank): a float32 GEMM of more rows may round the
    last bit differently. (A prompt's first position has no logprobs entry: None.)"""
    if value is None or (value and isinstance(value[0], int)):
        return None if value is None else list(value)
    return [None if d is None else sorted((t, round(e.logprob, 4), e.rank) for t, e in d.items()) for d in value]


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_ngram_drafting_with_pieces_equals_eager() -> None:
    """Model-free drafts read nothing of the forward: prompt steps replay the pieces, verification steps the decode
    graphs, and the tokens are those of an engine without the pieces."""
    off, on = _llm(False, speculative_config=NGRAM), _llm(True, speculative_config=NGRAM)
    assert on.engine.runner.graphs.prefill_graphs is not None

    def check(step: int, outs_off: list, outs_on: list) -> None:
        assert {o.request_id: list(o.token_ids) for o in outs_off} == {
            o.request_id: list(o.token_ids) for o in outs_on
        }, f"step {step}: tokens differ"

    repeats = [
        (i, [7, 8, 9, 10] * (2 + i) + [7, 8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for i in range(5)
    ]  # repeating prompts: ngram proposes drafts
    run_in_lockstep(off, on, repeats, check)
    assert counted(on).prefill_piece_steps > 0
    assert on.get_metrics()["spec_decode"]["num_drafts"] > 0


def test_unsupported_runs_say_why_and_run_eagerly(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.INFO):
        moe = _llm(True, "qwen3-moe-tiny")
    assert moe.engine.runner.graphs.prefill_graphs is None
    assert "no prefill graph pieces: layers other than dense DecoderLayer (MoeDecoderLayer)" in caplog.text
    # A draft model (EAGLE, MTP) reads the target's hidden states: its runs keep eager prompt steps.
    drafted = LLM("tiny", **{**BASE, "prefill_cuda_graphs": True, "speculative_config": NGRAM})
    monkeypatch.setattr(type(drafted.engine.runner.speculator), "num_kv_layers", property(lambda self: 1))
    with caplog.at_level(logging.INFO):
        drafted.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
    assert drafted.engine.runner.graphs.prefill_graphs is None
    assert "no prefill graph pieces: a draft model" in caplog.text
    assert unsupported_reason(torch.nn.Linear(2, 2)) == "Linear is not a decoder-only Llama-family model"
    out = moe.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_out_of_memory_while_capturing_leaves_prompt_steps_eager(caplog: pytest.LogCaptureFixture) -> None:
    class OutOfMemoryAtTheLargestSize(StaticInputsCapturer):
        def capture(self, step):  # type: ignore[no-untyped-def]
            if "PrefillPieceGraphs" in step.__qualname__:  # the decode graphs before them capture
                raise torch.OutOfMemoryError("CUDA out of memory (planted)")
            return super().capture(step)

    llm = LLM("tiny", **{**BASE, "prefill_cuda_graphs": True, "prefill_cuda_graph_sizes": SIZES})
    with caplog.at_level(logging.INFO):
        llm.engine.runner.capture_cuda_graphs(OutOfMemoryAtTheLargestSize())
    counted(llm)
    assert llm.engine.runner.graphs.prefill_graphs is None
    assert "no prefill graph pieces: out of device memory capturing them at up to 24 tokens" in caplog.text
    out = llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and counted(llm).prefill_piece_steps == 0


def test_embeddings_pooled_from_the_pieces_equal_eager() -> None:
    """Embedding requests pool the prompt's hidden states: those of the pieces' last output (prompts longer than
    the step budget pool across chunks)."""
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]
    vectors = {}
    for on in (False, True):
        llm = LLM(
            "random_tiny",
            task="embed",
            pooling="mean",
            **{**BASE, "prefill_cuda_graphs": on, "prefill_cuda_graph_sizes": SIZES},
        )
        llm.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
        counted(llm)
        vectors[on] = torch.stack([torch.as_tensor(o.embedding) for o in llm.encode(prompts, use_tqdm=False)])
        assert (counted(llm).prefill_piece_steps > 0) == on
    torch.testing.assert_close(vectors[True], vectors[False], rtol=1e-5, atol=1e-6)
