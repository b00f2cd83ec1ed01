"""A layer's view of wider KV rows (`layer_kv_view`: Gemma 4's KV tensors hold the widest layer's K/V per token, a
narrower layer reads the first `kv_heads * head_dim` values, a strided view): the KV stores and paged attention
(Triton kernels under the interpreter, and the references) on the view give what they give on a contiguous cache
of the layer's own shape, and leave the rest of every row alone (NaN there stays NaN)."""

from __future__ import annotations

import torch
from helpers.attention_cases import make_paged_case

from framework.layers.attention import triton_paged_attention as tpa
from framework.layers.attention.paged import paged_attention_reference, store_kv_reference
from framework.layers.attention.qk_norm_rope import qk_norm_rope_store_reference
from framework.layers.attention.triton_store_kv import store_kv as triton_store_kv
from framework.layers.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton
from framework.models.gemma4 import layer_kv_view

ROWS = [(40, 1), (0, 19), (21, 6), (9, 1)]  # (cached context, query) per row: decode and prefill rows
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 8
WIDE = (1, 64)  # the KV tensors' rows: one "head" of 64 values, of which this layer uses 2 x 16


def _view_of(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(wide tensor, the layer's strided view holding a copy of `cache`); the rest of each row is NaN."""
    wide = torch.full((*cache.shape[:3], *WIDE), float("nan"), dtype=cache.dtype)
    view = layer_kv_view(wide, KV_HEADS, HEAD_DIM)
    assert not view.is_contiguous() and view.shape == cache.shape
    view.copy_(cache)
    return wide, view


def _rest_is_untouched(wide: torch.Tensor) -> None:
    assert wide.flatten(3)[..., KV_HEADS * HEAD_DIM :].isnan().all()


def test_view_shape_and_strides() -> None:
    wide = torch.arange(2 * 3 * 4 * 64, dtype=torch.float32).view(2, 3, 4, 2, 32)
    view = layer_kv_view(wide, 1, 16)
    assert view.shape == (2, 3, 4, 1, 16) and view.stride() == (3 * 4 * 64, 4 * 64, 64, 16, 1)
    assert torch.equal(view[1, 2, 3, 0], wide[1, 2, 3, 0, :16])
    assert layer_kv_view(wide, 4, 16).is_contiguous()  # the widest layer: the tensor itself


def test_store_and_attention_on_the_view() -> None:
    """float32 (as the other attention interpreter tests: the interpreter's bfloat16 dots are not the GPU's)."""
    dtype = torch.float32
    case = make_paged_case(
        ROWS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK, dtype=dtype, seed=3
    )
    wide, view = _view_of(case.kv_cache)
    slots = case.meta.kv_slot_mapping
    store_kv_reference(case.key, case.value, case.kv_cache, slots)
    triton_store_kv(case.key, case.value, view, slots)
    torch.testing.assert_close(view, case.kv_cache, equal_nan=True, rtol=0, atol=0)
    _rest_is_untouched(wide)
    n = case.num_real_tokens
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, 0.25, window=12)
    tol = 2e-5
    for got in (
        paged_attention_reference(case.query, view, case.meta, 0.25, window=12),
        tpa.paged_attention(case.query, view, case.meta, 0.25, window=12),
    ):
        torch.testing.assert_close(got[:n], expected[:n], atol=tol, rtol=tol)
    # The reference store on the view writes the same place the kernel did.
    again_wide, again = _view_of(case.kv_cache)
    store_kv_reference(case.key, case.value, again, slots)
    torch.testing.assert_close(again, view, equal_nan=True, rtol=0, atol=0)
    _rest_is_untouched(again_wide)


def test_qk_norm_rope_store_into_the_view() -> None:
    num_tokens = 7
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
    angles = torch.rand(num_tokens, HEAD_DIM // 2, generator=g) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q_w, k_w = 1 + 0.3 * torch.randn(HEAD_DIM, generator=g), 1 + 0.3 * torch.randn(HEAD_DIM, generator=g)
    contiguous = torch.full((2, 4, BLOCK, KV_HEADS, HEAD_DIM), float("nan"))
    wide, view = _view_of(contiguous)
    slots = torch.tensor([3, 17, -1, 8, 30, 0, 12])
    args = (q_w, k_w, 1e-6, HEADS, KV_HEADS, HEAD_DIM)
    q_ref = qk_norm_rope_store_reference(qkv, cos, sin, *args, contiguous, slots, float32_scale=True)
    q = qk_norm_rope_store_triton(qkv, cos, sin, *args, view, slots, float32_scale=True)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(view, contiguous, equal_nan=True, rtol=1e-5, atol=1e-5)
    _rest_is_untouched(wide)
