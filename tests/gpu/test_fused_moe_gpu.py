"""The fused-MoE kernels against their PyTorch reference at Qwen3-30B-A3B's shapes, and the MoE models in the
engine, on a CUDA GPU.

Shapes: hidden 2048, expert intermediate 768, 128 experts, top-8, 1 to 8192 tokens. bf16/fp16: the kernel and
the reference (cuBLAS per expert) round the same intermediates but accumulate in other orders, so a tipped
rounding of gate/up propagates: the relative RMS error must stay under 1% and no element may be off by more than
1/8 of the output's RMS. float32 (no TF32 on either side): summation order only.
Also: the routing and alignment kernels against theirs, one compiled variant per launch configuration across
token counts, no host sync, CUDA-graph replay equal to eager, greedy parity of a tiny MoE checkpoint with HF
(CUDA graphs on and off) and with speculation.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_fused_moe_gpu.py`
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from framework.entrypoints.bench.triton_compiles import compiled_variants, new_variants  # noqa: E402
from framework.layers.kernels.fused_moe import (  # noqa: E402
    fused_moe,
    fused_moe_reference,
    fused_moe_triton,
    moe_launch_config,
)
from framework.layers.kernels.moe_align import ALIGN_KERNEL_MAX_ROWS, moe_align_reference, moe_align_triton  # noqa: E402
from framework.layers.kernels.moe_launch import moe_shape  # noqa: E402
from framework.layers.kernels.moe_route import moe_route_reference, moe_route_triton  # noqa: E402

DEVICE = "cuda"
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


def _problem(tokens: int, dtype: torch.dtype, seed: int, skew: float = 0.0) -> tuple[torch.Tensor, ...]:
    """Qwen3-30B-A3B-shaped inputs; routing from softmax router logits plus a per-expert bias of spread `skew`
    (0: every expert equally likely; 8: a dozen popular experts take nearly all tokens)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, device=DEVICE).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2, INTER, HIDDEN, generator=g, device=DEVICE) * HIDDEN**-0.5).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device=DEVICE) * INTER**-0.5).to(dtype)
    bias = torch.randn(EXPERTS, generator=g, device=DEVICE) * skew
    logits = torch.randn(tokens, EXPERTS, generator=g, device=DEVICE) + bias
    weights, ids = moe_route_reference(logits, TOP_K, True, torch.float32)
    return x, gate_up, down, weights, ids


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        return
    diff = out.float() - ref.float()
    rms = ref.float().pow(2).mean().sqrt().item()
    assert diff.pow(2).mean().sqrt().item() < 1e-2 * rms, "relative RMS error over 1%"
    assert diff.abs().max().item() < rms / 8, "an element is off by more than 1/8 of the RMS"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 16, 64, 256, 2048, 8192])
def test_kernel_matches_reference_at_real_shapes(tokens: int, dtype: torch.dtype) -> None:
    x, gate_up, down, weights, ids = _problem(tokens, dtype, seed=tokens)
    _assert_close(fused_moe_triton(x, gate_up, down, weights, ids), fused_moe_reference(x, gate_up, down, weights, ids))


@pytest.mark.parametrize("tokens", [3, 300])
def test_kernel_matches_reference_in_float32(tokens: int) -> None:
    x, gate_up, down, weights, ids = _problem(tokens, torch.float32, seed=5)
    _assert_close(fused_moe_triton(x, gate_up, down, weights, ids), fused_moe_reference(x, gate_up, down, weights, ids))


def test_skewed_routing_one_hot_expert() -> None:
    """Strongly skewed routing: a few experts get most of 4096 tokens (many rows per block), many get none."""
    x, gate_up, down, weights, ids = _problem(4096, torch.bfloat16, seed=9, skew=8.0)
    assert torch.bincount(ids.flatten(), minlength=EXPERTS).eq(0).any()
    _assert_close(fused_moe_triton(x, gate_up, down, weights, ids), fused_moe_reference(x, gate_up, down, weights, ids))


@pytest.mark.parametrize("tokens", [1, 16, 64, 256, ALIGN_KERNEL_MAX_ROWS // TOP_K])
def test_alignment_kernel_equals_reference(tokens: int) -> None:
    """The one-program alignment (its cursors shared through global memory between barriers) gives the sort's
    buffers exactly, at every decode size it serves."""
    _, _, _, _, ids = _problem(tokens, torch.bfloat16, seed=tokens, skew=3.0)
    block_m = moe_launch_config(ids.numel(), EXPERTS).block_m
    ref, got = moe_align_reference(ids, EXPERTS, block_m), moe_align_triton(ids, EXPERTS, block_m)
    assert torch.equal(got.num_padded, ref.num_padded)
    assert torch.equal(got.sorted_rows, ref.sorted_rows)
    used = int(ref.num_padded) // block_m
    assert torch.equal(got.block_expert[:used], ref.block_expert[:used])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routing_kernel_matches_reference(dtype: torch.dtype) -> None:
    """128 experts, top-8, renormalised, 4096 tokens: the same experts (up to the order of tied probabilities,
    frequent with bf16 logits) and the same weights."""
    g = torch.Generator(device=DEVICE).manual_seed(4)
    logits = (torch.randn(4096, EXPERTS, generator=g, device=DEVICE) * 2).to(dtype)
    ref_w, ref_ids = moe_route_reference(logits, TOP_K, True, dtype)
    got_w, got_ids = moe_route_triton(logits, TOP_K, True, dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, got_ids), probs.gather(1, ref_ids))
    assert (got_ids.sort(1).values.diff(dim=1) > 0).all(), "an expert chosen twice"
    torch.testing.assert_close(got_w, ref_w, rtol=2e-6 if dtype == torch.float32 else 2**-8, atol=1e-7)


def test_one_variant_per_launch_config_and_no_host_sync() -> None:
    """A token count whose tiles (the GPU's tuned table's, else the heuristic's) were launched before compiles
    nothing new, and no launch (table lookup included) syncs with the host."""
    x, gate_up, down, weights, ids = _problem(64, torch.bfloat16, seed=1)
    shape = moe_shape(x.device, "bfloat16", EXPERTS, INTER, HIDDEN, TOP_K)
    fused_moe(x[:1], gate_up, down, weights[:1], ids[:1])  # compile the decode variant
    seen = {moe_launch_config(TOP_K, EXPERTS, shape)}
    repeats = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for tokens in (2, 3, 5, 7, 16, 2, 3, 5, 7, 16):
            cfg = moe_launch_config(tokens * TOP_K, EXPERTS, shape)
            before = compiled_variants()
            fused_moe(x[:tokens], gate_up, down, weights[:tokens], ids[:tokens])
            if cfg in seen:
                repeats += 1
                assert new_variants(before, compiled_variants()) == {}, f"{tokens} tokens recompiled {cfg}"
            seen.add(cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert repeats >= 5  # the second pass at least


def test_cuda_graph_replay_equals_eager() -> None:
    x, gate_up, down, weights, ids = _problem(32, torch.bfloat16, seed=2)
    static_x, static_w, static_ids = x.clone(), weights.clone(), ids.clone()
    fused_moe(static_x, gate_up, down, static_w, static_ids)  # warm-up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(static_x, gate_up, down, static_w, static_ids)
    x2, _, _, w2, ids2 = _problem(32, torch.bfloat16, seed=3)  # new tokens and a new routing
    static_x.copy_(x2)
    static_w.copy_(w2)
    static_ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(static_out, fused_moe(x2, gate_up, down, w2, ids2), rtol=0, atol=0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_moe_greedy_parity_with_hf_on_gpu(tmp_path, graphs: bool) -> None:
    from helpers.hf_models import hf_greedy, random_prompts, save_tiny_checkpoint
    from helpers.hf_moe_models import MOE_SPEC_BY_NAME

    from framework import LLM, SamplingParams

    hf = save_tiny_checkpoint(MOE_SPEC_BY_NAME["qwen2moe-e6k3-shared"], tmp_path)
    prompts = random_prompts(6, 5, 60, seed=3)
    llm = LLM(
        str(tmp_path), device="cuda", dtype="float32", max_model_len=128, gpu_memory_utilization=0.3, cuda_graphs=graphs
    )
    assert (llm.engine.runner.graphs.cuda_graphs is not None) == graphs
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    del llm
    llm = LLM(
        str(tmp_path),
        device="cuda",
        dtype="float32",
        max_model_len=128,
        gpu_memory_utilization=0.3,
        cuda_graphs=graphs,
        speculative_config=spec,
    )
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
