"""Prefix caching on a GPU (skipped without CUDA): Triton attention reads shared blocks, including blocks
written earlier in the same step; outputs equal the uncached run; the step path with cache hits does not
sync with the host.

Run on the GPU machine: `python -m pytest -q tests/gpu/test_prefix_caching_gpu.py`.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.sync_check import step_without_host_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _prompts(block_size: int) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(250) for _ in range(300)]
    cuts = [5, block_size, 3 * block_size + 1, 300, 300]
    return [system[:cut] + [rng.randrange(250) for _ in range(rng.randint(0, 20))] for cut in cuts for _ in range(3)]


@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_same_tokens_with_and_without_prefix_caching_on_gpu(runner, block_size):
    from framework import LLM, SamplingParams

    prompts = _prompts(block_size)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=32, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs, cached = {}, {}
    for caching in (False, True):
        # fp32: the cached prefix's KV was computed in another batch; fp32 keeps near-ties from flipping.
        llm = LLM(
            "tiny",
            device="cuda",
            dtype="float32",
            runner=runner,
            block_size=block_size,
            max_model_len=512,
            gpu_memory_utilization=0.3,
            enable_prefix_caching=caching,
        )
        first = llm.generate(prompts, params, use_tqdm=False)  # same-step hits: one batch
        second = llm.generate(prompts, params, use_tqdm=False)  # hits on freed cached blocks
        outs[caching] = [o.token_ids for o in first + second]
        cached[caching] = sum(o.num_cached_tokens for o in first + second)
        assert llm.engine.is_idle()
        del llm
    assert outs[True] == outs[False]
    assert cached[False] == 0 and cached[True] > 0


def test_step_path_with_cache_hits_has_no_host_sync():
    from framework import LLM, SamplingParams

    llm = LLM("tiny", device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, async_scheduling=False)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    # Round 0 runs the same shapes unchecked: Triton compiles the kernel variants of a batch with cached context
    # then (a compile outlasts the busy kernel and would read as a host wait). Round 1 is checked.
    for round_, system in enumerate((list(range(100, 150)), list(range(40, 90)))):
        llm.generate([system + [1]], params, use_tqdm=False)  # caches the system prompt
        for i in range(8):
            engine.add_request(f"r{round_}-{i}", system + list(range(3 * i + 1)), params)
        for _ in range(5):
            if round_:
                step_without_host_sync(engine)
            else:
                engine.step()
        while not engine.is_idle():
            engine.step()
    assert engine.prefix_cache_stats.hits >= 2 * 8 * 48
