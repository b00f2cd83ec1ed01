"""Mamba-hybrid on a GPU (skipped without CUDA): kernels at real shapes, HF parity, no host sync on the step.

Run on the GPU machine: `python -m pytest -q tests/gpu/test_mamba_gpu.py`.
"""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_scan_and_conv_kernels_at_real_shapes():
    from framework.kernels.causal_conv1d import causal_conv1d_varlen_reference, causal_conv1d_varlen_triton
    from framework.kernels.selective_scan import (
        ScanInputs, ScanWeights, selective_scan_varlen_reference, selective_scan_varlen_triton,
        selective_state_update_reference, selective_state_update_triton,
    )

    dim, nstate, k = 2048, 16, 4
    lens = [300, 1, 1, 77, 1, 513]
    t, rows = sum(lens), len(lens)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    idx = torch.tensor([5, 0, 9, 3, 7, 1], dtype=torch.int32, device=dev)
    inp = ScanInputs(x=r(t, dim), dt=r(t, dim), B=r(t, nstate), C=r(t, nstate), z=r(t, dim))
    w = ScanWeights(A=-torch.rand(dim, nstate, device=dev, generator=g), D=r(dim), dt_bias=r(dim))
    s0 = r(12, dim, nstate)
    s_ref, s_tri = s0.clone(), s0.clone()
    ref = selective_scan_varlen_reference(inp, w, s_ref, idx, qsl)
    tri = selective_scan_varlen_triton(inp, w, s_tri, idx, qsl)
    torch.testing.assert_close(tri, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(s_tri, s_ref, atol=2e-3, rtol=2e-3)
    one = ScanInputs(*(v[:rows] for v in inp))
    s_ref, s_tri = s0.clone(), s0.clone()
    torch.testing.assert_close(selective_state_update_triton(one, w, s_tri, idx),
                               selective_state_update_reference(one, w, s_ref, idx), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_tri, s_ref, atol=1e-4, rtol=1e-4)
    x = r(t, dim).bfloat16()
    weight, bias = r(dim, k), r(dim)
    c0 = r(12, dim, k - 1).bfloat16()
    c_ref, c_tri = c0.clone(), c0.clone()
    torch.testing.assert_close(causal_conv1d_varlen_triton(x, weight, bias, c_tri, idx, qsl),
                               causal_conv1d_varlen_reference(x, weight, bias, c_ref, idx, qsl), atol=3e-2, rtol=2e-2)
    assert torch.equal(c_tri, c_ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_greedy_parity_with_hf_on_gpu(tmp_path, dtype):
    from hf_models import random_prompts
    from test_mamba_hybrid import JAMBA, build_hf_model

    from framework import LLM, SamplingParams

    hf = build_hf_model(JAMBA)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf = hf.to("cuda", getattr(torch, dtype))
    prompts = random_prompts(6, 5, 60, seed=3)
    llm = LLM(str(tmp_path), device="cuda", dtype=dtype, max_model_len=128, gpu_memory_utilization=0.3,
              max_num_batched_tokens=48)  # chunked prefill too
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    matches = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                          eos_token_id=None, pad_token_id=None)[0, len(prompt):].tolist()
        matches += out.token_ids == ref
    assert matches == len(prompts) if dtype == "float32" else matches >= len(prompts) - 1


def test_hybrid_step_path_has_no_host_sync():
    from framework import LLM, SamplingParams

    llm = LLM("jamba-tiny", device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, async_scheduling=False)
    engine = llm.engine
    for i in range(8):
        engine.add_request(f"r{i}", list(range(10 + 3 * i)),
                           SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=16, ignore_eos=True))
    for _ in range(2):  # warm-up (a prefill step, then a decode step): compilation and first allocations may sync
        engine.step()
    for _ in range(5):
        so = engine.scheduler.schedule()
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.runner.execute_model(so)
            future = engine.runner.sample_tokens()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        engine.scheduler.update_from_output(so, future.get().sampled_token_ids)
