"""Gemma 3 on a GPU (skipped without CUDA): the tiny random checkpoint of tests/models/test_hf_parity_gemma3.py
against HF transformers through the Triton kernels (window attention, q/k norm + RoPE store, the `1 + weight`
norms), with chunked prefill across the window; the same checkpoint quantized (FP8 block, GPTQ act-order) through
the W8A16 / W4A16 kernels against HF on the dequantized weights; and the `gemma-3-4b` geometry serving prompts of 3x
its window.

Run: `python3 -m pytest -q tests/gpu/test_gemma3_gpu.py`
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_parity_with_hf_on_gpu(tmp_path, dtype):
    from helpers.hf_models import hf_greedy, random_prompts, save_tiny_checkpoint
    from test_hf_parity_gemma3 import SPEC
    from transformers import AutoModelForCausalLM

    from framework import LLM, SamplingParams

    save_tiny_checkpoint(SPEC, tmp_path)
    # As served: from_pretrained keeps the RoPE frequencies float32 (a `.to(bf16)` would round them; mrv2 keeps them).
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype)).to("cuda")
    prompts = random_prompts(6, 20, 60, seed=3)  # 2.5 to 7.5 windows of 8
    llm = LLM(
        str(tmp_path),
        device="cuda",
        dtype=dtype,
        max_model_len=128,
        gpu_memory_utilization=0.3,
        max_num_batched_tokens=16,  # chunk boundaries inside and across the window
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    with torch.device("cuda"):
        matches = sum(out.token_ids == hf_greedy(hf, prompt, 24) for prompt, out in zip(prompts, outs))
    # fp32: exact. bf16: different kernels round differently, so a near-tie may flip late in a sequence.
    assert matches == len(prompts) if dtype == "float32" else matches >= len(prompts) - 1


@pytest.mark.parametrize("fmt", ["fp8-block", "gptq-act-asym"])
def test_quantized_checkpoint_matches_hf_dequantized_on_gpu(tmp_path, fmt):
    from helpers.hf_models import hf_greedy, random_prompts
    from helpers.quant_checkpoints import write_quantized
    from test_hf_parity_gemma3 import SPEC

    from framework import LLM, SamplingParams

    hf = write_quantized(fmt, tmp_path, SPEC).to("cuda")
    prompts = random_prompts(4, 12, 40, seed=5)  # 1.5 to 5 windows of 8
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=96, gpu_memory_utilization=0.3)
    assert llm.engine.runner.model.model.layers[0].self_attn.q_proj.quant_method is not None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    with torch.device("cuda"):
        assert [out.token_ids for out in outs] == [hf_greedy(hf, prompt, 16) for prompt in prompts]


def test_gemma_3_4b_geometry_serves_prompts_longer_than_the_window():
    from framework import LLM, SamplingParams

    llm = LLM("gemma-3-4b", device="cuda", dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.5)
    prompts = [[(7 * i + j) % 256 for j in range(3000 + 100 * i)] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [16] * 4
