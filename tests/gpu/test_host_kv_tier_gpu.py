"""The host KV tier on a GPU (skipped without CUDA): copies on a real side stream into pinned memory give the same
tokens as no tier, on conversations whose blocks the device pool evicts between turns; a step that saves and loads
blocks does not wait on the host; hybrid models' recurrent-state snapshots travel with their blocks.

Run on the GPU machine: `python -m pytest -q tests/gpu/test_host_kv_tier_gpu.py`.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.sync_check import step_without_host_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _conversations(llm, turns: int = 3, num: int = 12, length: int = 200, max_tokens: int = 16) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from framework import SamplingParams

    rng = random.Random(0)
    history = [[rng.randrange(250) for _ in range(length)] for _ in range(num)]
    tokens = []
    for turn in range(turns):
        prompts = [h + [rng.randrange(250) for _ in range(5)] for h in history]
        params = [
            SamplingParams(
                temperature=0.0 if i % 2 else 0.8, seed=100 * turn + i, max_tokens=max_tokens, ignore_eos=True
            )
            for i in range(len(prompts))
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens += [o.token_ids for o in outs]
        history = [p + o.token_ids for p, o in zip(prompts, outs)]
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_same_tokens_with_and_without_the_host_tier_on_gpu(kv_cache_dtype):
    from framework import LLM

    outs = {}
    for gib in (0.0, 0.5):
        # fp32: loaded blocks were computed in other batches; fp32 keeps near-ties from flipping. 80 blocks of 16
        # tokens hold about a quarter of the 12 conversations.
        llm = LLM(
            "tiny",
            device="cuda",
            dtype="float32",
            block_size=16,
            num_kv_blocks=80,
            max_model_len=512,
            kv_cache_dtype=kv_cache_dtype,
            host_kv_gib=gib,
            enable_prefix_caching=True,
        )
        outs[gib] = _conversations(llm)
        stats = llm.engine.kv_tier_stats
        if gib:
            assert stats.hit_tokens > 0 and stats.failed_loads == 0 and stats.bytes_to_tier > 0
        assert llm.engine.is_idle()
        del llm
    assert outs[0.5] == outs[0.0]


def test_steps_that_save_and_load_do_not_sync_with_the_host():
    from framework import LLM, SamplingParams

    llm = LLM(
        "tiny",
        device="cuda",
        dtype="bfloat16",
        block_size=16,
        num_kv_blocks=40,
        max_model_len=512,
        host_kv_gib=0.25,
        enable_prefix_caching=True,
        async_scheduling=False,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True)
    contexts = [[(7 * c + i) % 250 for i in range(300)] for c in range(4)]
    for round_ in range(2):  # round 0 compiles the kernel variants; round 1 is checked
        llm.generate(contexts, params, use_tqdm=False)  # each context evicts the one before: they go to the host
        for i, context in enumerate(contexts):
            engine.add_request(f"r{round_}-{i}", context + [1, 2], params)
        for _ in range(4):
            if round_:
                step_without_host_sync(engine)
            else:
                engine.step()
        while not engine.is_idle():
            engine.step()
    assert engine.kv_tier_stats.hit_tokens > 0


@pytest.mark.parametrize("model", ["jamba", "qwen3_5"])
def test_hybrid_snapshots_travel_through_the_host_tier_on_gpu(tmp_path, model):
    """A Mamba (Jamba) and a Gated DeltaNet (Qwen3.5) hybrid: conversations evicted between turns come back from
    the host tier with their recurrent-state snapshots (pinned memory, real side stream), with the same tokens as
    without any prefix caching (fp32, greedy and seeded sampling)."""
    from helpers.gdn_models import QWEN3_5, slow_decay_checkpoint
    from test_mamba_hybrid import JAMBA, build_hf_model

    from framework import LLM

    if model == "jamba":
        build_hf_model(JAMBA).save_pretrained(tmp_path, safe_serialization=True)
    else:
        slow_decay_checkpoint(QWEN3_5, tmp_path)
    outs = {}
    for caching, gib in ((False, 0.0), (True, 0.25)):
        # 24 blocks of 16 tokens hold about a third of the 8 conversations: every turn evicts the others.
        llm = LLM(
            str(tmp_path),
            device="cuda",
            dtype="float32",
            block_size=16,
            num_kv_blocks=24,
            max_model_len=256,  # at most 24 blocks of 16: a request of max_model_len must fit the cache
            host_kv_gib=gib,
            enable_prefix_caching=caching,
        )
        outs[caching] = _conversations(llm, num=8, length=120, max_tokens=8)
        stats = llm.engine.kv_tier_stats
        if gib:
            assert stats.hit_tokens > 0 and stats.snapshot_hits > 0 and stats.failed_loads == 0
        assert llm.engine.is_idle()
        del llm
    assert outs[True] == outs[False]
