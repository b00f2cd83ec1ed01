"""The prefill attention kernel (framework/layers/attention/triton_prefill_attention.py) at real shapes, on a CUDA GPU.

Qwen3-0.6B geometry (16 query heads, 8 KV heads, head_dim 128, bfloat16, 16-token pages): the prefix_bench
prefill batches (four ~2,040-token prompts, a prompt continued after a 32-token chunk, decode rows beside),
a causal 8,192-token prefill, 2,048 tokens after 2,048 cached, other geometries, every variant the sweep
(`bench_prefill_attention.py`, removed; at commit 1e476a2) timed, `paged_attention`'s default route of large rows
to it and CUDA-graph replay.
Tolerances as tests/gpu/test_attention_gpu.py: elementwise against a float32 reference (atol = rtol = 2e-2
for bf16) and a mean error at most twice the bf16 reference's. Skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from helpers.attention_cases import make_paged_case  # noqa: E402

from framework.layers.attention import triton_paged_attention as tpa  # noqa: E402
from framework.layers.attention import triton_prefill_attention as tfa  # noqa: E402
from framework.layers.attention.paged import paged_attention_reference, store_kv_reference  # noqa: E402

QWEN3 = dict(num_heads=16, num_kv_heads=8, head_dim=128)
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
BASE = tfa.PrefillVariant()
VARIANTS = {  # the code paths the sweep times (tile sizes are covered by test_tiles)
    "default": BASE,
    "k_rows_trans": dataclasses.replace(BASE, k_trans=False),
    "q_prescale": dataclasses.replace(BASE, q_prescale=True),
    "forward_order": dataclasses.replace(BASE, reverse=False),
    "no_prefetch": dataclasses.replace(BASE, prefetch_pages=False),
    "one_head_per_tile": dataclasses.replace(BASE, heads=1),
    "warp_spec": dataclasses.replace(BASE, warp_spec=True),
    "qk_ahead": dataclasses.replace(BASE, qk_ahead=True, block_n=64),
}
ROWS = {
    "prefix_bench_fresh": [(0, 2040), (0, 2031), (0, 2064), (0, 2025), (0, 32)],
    "prefix_bench_continued": [(2100, 1)] * 64 + [(32, 2012), (0, 2050), (0, 2017), (0, 2044)],
    "prefix_2048_after_2048": [(2048, 2048)],
    "unaligned_mixed": [(1000, 2048), (0, 333), (3000, 1), (17, 300)],
}


def _check(rows, variant=None, *, dtype=torch.bfloat16, block_size=16, switch=False, seed=0, **shape):
    shape = {**QWEN3, **shape}
    case = make_paged_case(
        rows, block_size=block_size, dtype=dtype, device="cuda", num_pad_tokens=5, seed=seed, poison=True, **shape
    )
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    scale = 1 / math.sqrt(shape["head_dim"])
    n = case.num_real_tokens
    if switch:  # through paged_attention, decode rows and all
        out = tpa.paged_attention(case.query, case.kv_cache, case.meta, scale)[:n].float()
    else:
        out = tfa.prefill_attention(case.query, case.kv_cache, case.meta, scale, variant=variant)[:n].float()
    ref = paged_attention_reference(case.query, case.kv_cache, case.meta, scale)[:n].float()
    ref32 = paged_attention_reference(case.query.float(), case.kv_cache.float(), case.meta, scale)[:n]
    assert torch.isfinite(out).all()
    tol = TOL[dtype]
    torch.testing.assert_close(out, ref32, atol=tol, rtol=tol)
    err, ref_err = (out - ref32).abs().mean().item(), (ref - ref32).abs().mean().item()
    assert err <= 2 * ref_err + 1e-4, (err, ref_err)


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_at_prefix_bench_shapes(rows, variant):
    _check(ROWS[rows], VARIANTS[variant], seed=len(rows))


@pytest.mark.parametrize(
    "tiles",
    [
        "block_n=64",
        "block_n=64,num_stages=4",
        "block_m=64,num_warps=4",
        "block_m=64,block_n=64,num_warps=4,num_stages=4",
        "num_stages=2",
        "block_n=64,loop_stages=5",
    ],
)
def test_tiles(tiles):
    _check(ROWS["prefix_bench_continued"], tfa.PrefillVariant.parse(tiles))


def test_causal_8192():
    _check([(0, 8192)], BASE)


def test_paged_attention_routes_large_rows_here():
    _check(ROWS["prefix_bench_continued"], switch=True)
    _check(ROWS["unaligned_mixed"], switch=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        dict(num_heads=8, num_kv_heads=8, head_dim=64),  # MHA, head_dim 64
        dict(num_heads=28, num_kv_heads=4, head_dim=128),  # group of 7 (Qwen2-7B)
        dict(num_heads=32, num_kv_heads=8, head_dim=128),  # group of 4 (Llama-3-8B)
    ],
)
def test_other_geometries(dtype, shape):
    _check([(2000, 1), (10, 40), (500, 300), (0, 640)], dtype=dtype, **shape)


@pytest.mark.parametrize("block_size", [1, 64, 256])
def test_block_sizes(block_size):
    _check([(700, 100), (300, 200), (0, 1200)], BASE, block_size=block_size)


def test_cuda_graph_replay():
    """Captured once, replayed on new query values: same output as an eager call (the engine's graphs)."""
    case = make_paged_case(
        ROWS["unaligned_mixed"], block_size=16, dtype=torch.bfloat16, device="cuda", poison=False, **QWEN3
    )
    out = torch.zeros_like(case.query)
    run = lambda: tfa.prefill_attention(case.query, case.kv_cache, case.meta, 0.088, out)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    case.query.copy_(torch.randn_like(case.query))
    graph.replay()
    torch.cuda.synchronize()
    captured = out.clone()
    out.zero_()
    run()
    torch.testing.assert_close(captured, out, atol=0, rtol=0)
