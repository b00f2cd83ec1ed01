"""Full-step CUDA graphs (runner.full_step_cuda_graphs) on a GPU, with real torch.cuda.graph capture.

- on == off at the Qwen3-0.6B geometry (random weights, float32 so that the two paths' different GEMM shapes in
  the LM head, B padded rows vs R rows, cannot flip a near-tie): greedy and seeded sampling mixes, requests of
  different lengths (the batch shrinks through several graph sizes, with padding rows), a penalised row
  (penalty variant, in the graph) and a row with logprobs that makes its steps fall back;
- a full-step decode step queues without a host sync (tests/sync_check.py) and really replays whole.
"""

from __future__ import annotations

import pytest
import torch

from sync_check import step_without_host_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ENGINE = {"device": "cuda", "dtype": "float32", "max_model_len": 512, "max_num_seqs": 48, "seed": 0,
          "gpu_memory_utilization": 0.3}


def _params() -> list:
    from framework import SamplingParams

    mixes = [dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=1.0, top_k=20, seed=2),
             dict(temperature=0.7, top_p=0.8, seed=3), dict(temperature=1.1, min_p=0.1, seed=4),
             dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, seed=5)]
    out = [SamplingParams(**mixes[i % len(mixes)], max_tokens=8 + 3 * i, ignore_eos=True) for i in range(30)]
    out += [SamplingParams(temperature=0.0, logprobs=3, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=9, repetition_penalty=1.2, max_tokens=20, ignore_eos=True)]
    return out


def test_full_step_graphs_equal_eager_sampler_at_real_shapes() -> None:
    from framework import LLM

    prompts = [[(7 * i + 13 * j) % 151_000 for j in range(20 + 11 * i)] for i in range(32)]
    results = {}
    for on in (False, True):
        llm = LLM("qwen3-0.6b", **ENGINE, full_step_cuda_graphs=on)
        outs = llm.generate(prompts, _params(), use_tqdm=False)
        results[on] = [o.token_ids for o in outs]
        runner = llm.engine.runner
        if on:
            assert runner.step_graphs is not None
            assert runner.full_step_replays > 20, runner.full_step_fallbacks
            assert "logprobs" in runner.full_step_fallbacks, runner.full_step_fallbacks
        llm.shutdown()
    assert results[True] == results[False]


def test_full_step_decode_queues_without_host_sync() -> None:
    from framework import LLM, SamplingParams

    # float32 as above: the kernels compiled there serve here (the piece has 120 s).
    llm = LLM("qwen3-0.6b", **ENGINE, full_step_cuda_graphs=True, async_scheduling=False)
    engine = llm.engine
    for i in range(5):  # 5 rows: padded to the graph of 8
        engine.add_request(f"r{i}", [(31 * i + j) % 1000 for j in range(40)],
                           SamplingParams(temperature=0.7, top_k=40, seed=i, max_tokens=64, ignore_eos=True))
    for _ in range(4):  # prefill, then decode steps: every Triton variant compiled
        engine.step()
    before = engine.runner.full_step_replays
    for _ in range(3):
        step_without_host_sync(engine)
    assert engine.runner.full_step_replays == before + 3
    llm.shutdown()
