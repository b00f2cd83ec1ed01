"""Full-step CUDA graphs (runner.full_step_cuda_graphs) on a GPU, with real torch.cuda.graph capture.

- on == off at the Qwen3-0.6B geometry (random weights, float32 so that the two paths' different GEMM shapes in
  the LM head, B padded rows vs R rows, cannot flip a near-tie): greedy and seeded sampling mixes, requests of
  different lengths (the batch shrinks through several graph sizes, with padding rows), a penalised row
  (penalty variant, in the graph) and rows with logprobs / top-k logprobs, min_tokens, logit_bias and
  allowed_token_ids (the general variant, in the graph: no step falls back but prefills); logprob values
  within 1e-3 (the LM head's GEMM shapes differ), chosen ranks and top-k id sets equal;
- a bf16 engine, whose plain and cutoff variants give the sampler the bf16 logits, equals the same engine with
  float32 logits exactly (tokens, logprobs);
- a full-step decode step queues without a host sync (tests/helpers/sync_check.py) and really replays whole: the cutoff
  variant, then the general variant (a row with logprobs, a bias and min_tokens joins).
"""

from __future__ import annotations

import pytest
import torch
from helpers.observed import counted
from helpers.sync_check import step_without_host_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STOP = 1234  # biased up: without min_tokens the row would stop at once
ALLOWED = [11, 222, 3333, 44_444, 100_000]
THINK_END = [198, 151_668]  # "\n</think>" in Qwen3's vocabulary: the thinking budget forces it
ENGINE = {
    "device": "cuda",
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 48,
    "seed": 0,
    "gpu_memory_utilization": 0.8,  # of one xdist worker's share too: 8,192-token float32 logits peak at ~5 GB
}


def _params() -> list:
    from framework import SamplingParams

    mixes = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, top_k=20, seed=2),
        dict(temperature=0.7, top_p=0.8, seed=3),
        dict(temperature=1.1, min_p=0.1, seed=4),
        dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, seed=5),
    ]
    out = [SamplingParams(**mixes[i % len(mixes)], max_tokens=8 + 3 * i, ignore_eos=True) for i in range(30)]
    out += [
        SamplingParams(temperature=0.0, logprobs=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=9, repetition_penalty=1.2, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=10, top_k=40, logprobs=5, max_tokens=16, ignore_eos=True),
        SamplingParams(
            temperature=0.0,
            min_tokens=6,
            stop_token_ids=[STOP],
            logit_bias={STOP: 60.0},
            max_tokens=14,
            ignore_eos=True,
        ),
        SamplingParams(
            temperature=0.7, seed=11, logit_bias={5: 8.0, 77: -100.0}, logprobs=1, max_tokens=18, ignore_eos=True
        ),
        SamplingParams(temperature=1.0, seed=12, allowed_token_ids=ALLOWED, max_tokens=15, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            seed=13,
            thinking_token_budget=5,
            thinking_end_token_ids=THINK_END,
            max_tokens=16,
            ignore_eos=True,
        ),
    ]
    return out


def _logprobs(out) -> list[dict[int, tuple[float, int]]]:  # type: ignore[no-untyped-def]
    return [{t: (e.logprob, e.rank) for t, e in d.items()} for d in (out.logprobs or [])]


def test_full_step_graphs_equal_eager_sampler_at_real_shapes() -> None:
    from framework import LLM

    prompts = [[(7 * i + 13 * j) % 151_000 for j in range(20 + 11 * i)] for i in range(len(_params()))]
    results, logprobs = {}, {}
    for on in (False, True):
        llm = LLM("qwen3-0.6b", **ENGINE, full_step_cuda_graphs=on)
        counts = counted(llm)
        outs = llm.generate(prompts, _params(), use_tqdm=False)
        results[on] = [o.token_ids for o in outs]
        logprobs[on] = [_logprobs(o) for o in outs]
        runner = llm.engine.runner
        if on:
            graphs = runner.graphs.step_graphs
            assert graphs is not None
            assert counts.full_step_replays > 20, counts.full_step_fallbacks
            assert set(counts.full_step_fallbacks) <= {"not pure decode"}, counts.full_step_fallbacks
            assert sum(g.num_replays for (_, v), g in graphs.graphs.items() if v == graphs.general) > 5
        llm.shutdown()
    assert results[True] == results[False]
    out = results[True]
    assert set(out[-2]) <= set(ALLOWED) and STOP not in out[-4][:6] and len(out[-4]) >= 6
    ended_itself = any(out[-1][i : i + 2] == THINK_END for i in range(4))
    assert out[-1][5:7] == THINK_END or ended_itself  # forced after 5 tokens (inside the general variant's graph)
    for off_rows, on_rows in zip(logprobs[False], logprobs[True]):
        assert len(off_rows) == len(on_rows)
        for a, b in zip(off_rows, on_rows):
            assert set(a) == set(b), (a, b)
            for t, (value, rank) in a.items():
                assert abs(b[t][0] - value) <= 1e-3 and b[t][1] == rank, (t, a, b)


def test_bf16_logits_equal_float32_logits_with_full_step_graphs(monkeypatch) -> None:
    """A bf16 engine (the Qwen3-0.6B geometry, full-step graphs on): its logits reach the sampler in bf16 (the plain
    and cutoff variants read them so; penalties, bias, allowed ids and logprobs get a float32 copy). Tokens and
    logprobs equal, exactly, those of the same engine with `compute_logits` returning float32 (the `.float()` it
    had): both run the same LM head GEMMs, so no tolerance."""
    from framework import LLM
    from framework.models.llama import LlamaForCausalLM

    prompts = [[(7 * i + 13 * j) % 151_000 for j in range(20 + 11 * i)] for i in range(len(_params()))]
    engine = {**ENGINE, "dtype": "bfloat16"}
    results = {}
    compute_logits = LlamaForCausalLM.compute_logits
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(LlamaForCausalLM, "compute_logits", lambda self, h: compute_logits(self, h).float())
        llm = LLM("qwen3-0.6b", **engine, full_step_cuda_graphs=True)
        counts = counted(llm)
        outs = llm.generate(prompts, _params(), use_tqdm=False)
        results[forced] = [(o.token_ids, _logprobs(o)) for o in outs]
        assert counts.full_step_replays > 20
        llm.shutdown()
    assert results[False] == results[True]


def test_full_step_decode_queues_without_host_sync() -> None:
    from framework import LLM, SamplingParams

    # float32 as above: the kernels compiled there serve here (the piece has 120 s).
    llm = LLM("qwen3-0.6b", **ENGINE, full_step_cuda_graphs=True, async_scheduling=False)
    engine = llm.engine
    counts = counted(llm)
    for i in range(5):  # 5 rows: padded to the graph of 8
        engine.add_request(
            f"r{i}",
            [(31 * i + j) % 1000 for j in range(40)],
            SamplingParams(temperature=0.7, top_k=40, seed=i, max_tokens=64, ignore_eos=True),
        )
    for _ in range(4):  # prefill, then decode steps: every Triton variant compiled
        engine.step()
    before = counts.full_step_replays
    for _ in range(3):
        step_without_host_sync(engine)
    assert counts.full_step_replays == before + 3
    graphs = engine.runner.graphs.step_graphs
    engine.add_request(
        "g",
        [(17 * j) % 1000 for j in range(30)],  # the general variant from its first decode step
        SamplingParams(
            temperature=0.0,
            logprobs=4,
            min_tokens=8,
            stop_token_ids=[STOP],
            logit_bias={STOP: 60.0, 9: 2.0},
            max_tokens=64,
            ignore_eos=True,
        ),
    )
    for _ in range(2):  # its prefill (eager sampler), then one general replay: the copy-out path warms up
        engine.step()
    general = sum(g.num_replays for (_, v), g in graphs.graphs.items() if v == graphs.general)
    for _ in range(2):
        step_without_host_sync(engine)
    assert sum(g.num_replays for (_, v), g in graphs.graphs.items() if v == graphs.general) == general + 2 > 2
    llm.shutdown()
