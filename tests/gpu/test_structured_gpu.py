"""Structured outputs on a GPU (skipped without CUDA): the bitmask kernel at real shapes against its reference,
and the engine on the device (async copies of masks and drafts, CUDA graphs, ngram speculation).

Run on the GPU machine: `python -m pytest -q tests/gpu/test_structured_gpu.py`.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 151936  # Qwen3's


@pytest.mark.parametrize("num_logits, num_masked", [(256, 128), (1280, 640), (64, 64)])
def test_bitmask_kernel_at_real_shapes(num_logits: int, num_masked: int) -> None:
    from samplers.structured.bitmask import apply_token_bitmask_reference, apply_token_bitmask_triton, bitmask_words

    g = torch.Generator(device="cuda").manual_seed(num_logits)
    logits = torch.randn(num_logits, VOCAB, device="cuda", generator=g)
    masks = torch.randint(
        -(2**31), 2**31 - 1, (num_masked, bitmask_words(VOCAB)), device="cuda", generator=g, dtype=torch.int64
    ).to(torch.int32)
    masks[0] = 0
    masks[0, 3] = 1 << 5  # one allowed token: 3 * 32 + 5
    rows = torch.randperm(num_logits, device="cuda", generator=g)[:num_masked].to(torch.int32)
    ref = apply_token_bitmask_reference(logits.clone(), masks, rows)
    got = apply_token_bitmask_triton(logits.clone(), masks, rows)
    assert torch.equal(got, ref)
    assert int(torch.isfinite(got[rows[0]]).sum()) == 1 and torch.isfinite(got[rows[0], 101])


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["a", "bb", "ccc"]},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "tag", "name"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "speculator",
    [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}],
    ids=["none", "ngram"],
)
def test_engine_on_the_device(speculator) -> None:
    from framework import LLM, SamplingParams, StructuredOutputsParams

    kwargs = {"speculative_config": speculator} if speculator else {}
    llm = LLM("random_tiny", device="cuda", max_num_seqs=64, **kwargs)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(
            temperature=0.9, seed=s, max_tokens=64, structured_outputs=so if s % 2 else None, ignore_eos=not s % 2
        )
        for s in range(48)
    ]
    outs = llm.generate([[65 + s % 26, 66, 67] for s in range(48)], params, use_tqdm=False)
    stopped = [o for o, p in zip(outs, params) if p.structured_outputs is not None and o.finish_reason == "stop"]
    assert len(stopped) >= 18
    for o in stopped:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert llm.engine.runner.sampling_states.structured.num_refused == 0
    greedy = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=so)
    plain = LLM("random_tiny", device="cuda")
    prompts = [[70 + s, 66] for s in range(8)]
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == [
        o.token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)
    ]


@pytest.mark.parametrize(
    "speculator",
    [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}],
    ids=["none", "ngram"],
)
def test_grammar_fill_does_not_wait_for_the_forward(speculator) -> None:
    """Queueing a step with constrained rows (matcher advance, mask fill, drafts read, mask copy) never waits for
    the device work of that step: the previous step's tokens and drafts were copied before it started."""
    from helpers.sync_check import step_without_host_sync

    from framework import LLM, SamplingParams, StructuredOutputsParams

    kwargs = {"speculative_config": speculator} if speculator else {}
    llm = LLM(
        "random_tiny", device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, async_scheduling=False, **kwargs
    )
    engine = llm.engine
    so = StructuredOutputsParams(regex="(ab|cd|[0-9]){40}")
    for i in range(8):
        engine.add_request(
            f"r{i}",
            [97, 98, 99, 100] * 3 + [48 + i],
            SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, structured_outputs=so if i % 2 else None),
        )
    engine.step()  # warm-up: compilation and first allocations may sync
    engine.step()
    for _ in range(5):
        step_without_host_sync(engine)
    assert engine.runner.sampling_states.structured.num_refused == 0
