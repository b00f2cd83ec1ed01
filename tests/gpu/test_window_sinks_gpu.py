"""Sliding-window and sink attention (the Triton kernels) against the PyTorch reference at real shapes on a GPU.

Geometries: gpt-oss-20b (64 query heads, 8 KV heads, head_dim 64, window 128, sinks) and Gemma 3 (head_dim 256,
window 1,024, no sinks), bfloat16, KV blocks of 16 tokens; decode batches of 1 to 256 rows (split and unsplit),
draft-verify rows, prefill chunks that start before, inside and past the window. Tolerances as in
tests/gpu/test_attention_gpu.py: against a float32 reference on the same data, atol = rtol = 2e-2, and the
kernel's mean error at most twice the bf16 reference's plus 1e-4. Skipped without CUDA.
Run: `python3 -m pytest -q tests/gpu/test_window_sinks_gpu.py`
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from helpers.attention_cases import make_paged_case  # noqa: E402

from framework.layers.attention.paged import paged_attention_reference, store_kv_reference  # noqa: E402
from framework.layers.attention.triton_paged_attention import paged_attention  # noqa: E402

GPT_OSS = dict(num_heads=64, num_kv_heads=8, head_dim=64)
GEMMA3 = dict(num_heads=8, num_kv_heads=4, head_dim=256)


def _check(rows, shape, window: int, with_sinks: bool, **kwargs) -> None:
    case = make_paged_case(rows, block_size=16, dtype=torch.bfloat16, device="cuda", seed=len(rows), **shape)
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sinks = torch.randn(shape["num_heads"], generator=gen, device="cuda") * 2 if with_sinks else None
    scale = 1 / math.sqrt(shape["head_dim"])
    n = case.num_real_tokens
    out = paged_attention(case.query, case.kv_cache, case.meta, scale, window=window, sinks=sinks, **kwargs)[:n].float()
    ref = paged_attention_reference(case.query, case.kv_cache, case.meta, scale, window, sinks)[:n].float()
    ref32 = paged_attention_reference(case.query.float(), case.kv_cache.float(), case.meta, scale, window, sinks)[:n]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref32, atol=2e-2, rtol=2e-2)
    err, ref_err = (out - ref32).abs().mean().item(), (ref - ref32).abs().mean().item()
    assert err <= 2 * ref_err + 1e-4, (err, ref_err)


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_gpt_oss(batch, num_splits):
    gen = torch.Generator().manual_seed(batch)
    rows = [(int(n), 1) for n in torch.randint(1, 8192, (batch,), generator=gen)]
    _check(rows, GPT_OSS, 128, True, num_splits=num_splits)


@pytest.mark.parametrize(
    "rows",
    [
        [(0, 2048)],
        [(2048, 2048)],
        [(100, 300), (0, 77), (5000, 1)],
        [(4000, 1)] * 64 + [(1500, 2048)],
        [(3000, 4)] * 16,
    ],
    ids=["fresh", "prefix", "mixed", "decodes_plus_chunk", "verify"],
)
@pytest.mark.parametrize("geometry", ["gpt_oss", "gemma3"])
def test_prefill_and_mixed(rows, geometry):
    shape, window, sinks = (GPT_OSS, 128, True) if geometry == "gpt_oss" else (GEMMA3, 1024, False)
    _check(rows, shape, window, sinks)


def test_full_attention_with_sinks():
    """gpt-oss's full layers: sinks without a window."""
    _check([(3000, 1)] * 32 + [(500, 700)], GPT_OSS, 0, True)


@pytest.mark.parametrize("geometry", ["gpt_oss", "mistral"])
def test_blocks_released_by_the_window_are_not_read(geometry):
    """KV memory that follows the window (docs/sliding-window.md#kv-memory): a block wholly before a row's first
    window goes back to the pool and holds another request's K/V. Here every such block is overwritten with large
    finite values after a first run: the output stays the same (real KV tiles span several 16-token pages, so the
    first tile of a window loads some released pages and must mask them)."""
    shape, window = (
        (GPT_OSS, 128) if geometry == "gpt_oss" else (dict(num_heads=32, num_kv_heads=8, head_dim=128), 4096)
    )
    rows = [(5000 + 37 * i, 1) for i in range(32)] + [(6000, 3), (4500, 700)]
    case = make_paged_case(rows, block_size=16, dtype=torch.bfloat16, device="cuda", seed=3, **shape)
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    scale, n = 1 / math.sqrt(shape["head_dim"]), case.num_real_tokens
    before = paged_attention(case.query, case.kv_cache, case.meta, scale, window=window)[:n].float()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for row, (context, _) in enumerate(rows):
        for page in range(max(context - window + 1, 0) // 16):
            block = case.kv_cache[:, int(case.meta.block_tables[row, page])]
            block.copy_(100 * torch.randn(block.shape, generator=gen, device="cuda"))
    after = paged_attention(case.query, case.kv_cache, case.meta, scale, window=window)[:n].float()
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, atol=1e-3, rtol=1e-3)
