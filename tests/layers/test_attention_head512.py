"""Head_dim 512 (Gemma 4's full layers, `global_head_dim`): the Triton kernels (decode unsplit and split with
either merge, the prefill kernel, the older large-row launch) on the CPU interpreter in float32 against the
PyTorch reference, with a sliding window and sinks, on the strided view of wider KV rows that Gemma 4's layers
read (`layer_kv_view`); the sm_90 tiles of 512-wide heads, and those of every other head size left as they were."""

from __future__ import annotations

import pytest
import torch
from helpers.attention_cases import make_paged_case

from framework.layers.attention import triton_paged_attention as tpa
from framework.layers.attention.backend import TRITON_HEAD_DIMS, attention_backend
from framework.layers.attention.launch_config import AttentionTiles, decode_tiles, prefill_tiles
from framework.layers.attention.paged import paged_attention_reference, store_kv_reference
from framework.layers.attention.triton_prefill_attention import PrefillVariant, default_variant
from framework.layers.attention.triton_store_kv import store_kv as triton_store_kv
from framework.models.gemma4 import layer_kv_view

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 512, 16
WIDE = (1, 2048)  # one wider KV row per token (a sliding layer's heads): this layer reads its first 2 x 512 values
ROWS = [(40, 1), (0, 19), (21, 6), (9, 1)]  # (cached context, query) per row: decode and prefill rows
SCALE = 512**-0.5
TOL = 2e-5


def _case(rows: list[tuple[int, int]], seed: int):
    """(case, the layer's strided view of wide KV rows holding the case's cache; the rest of each row NaN)."""
    case = make_paged_case(
        rows,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        dtype=torch.float32,
        seed=seed,
    )
    wide = torch.full((*case.kv_cache.shape[:3], *WIDE), float("nan"))
    view = layer_kv_view(wide, KV_HEADS, HEAD_DIM)
    assert not view.is_contiguous()
    view.copy_(case.kv_cache)  # the cached context
    triton_store_kv(case.key, case.value, view, case.meta.kv_slot_mapping)
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    torch.testing.assert_close(view, case.kv_cache, equal_nan=True, rtol=0, atol=0)
    assert wide.flatten(3)[..., KV_HEADS * HEAD_DIM :].isnan().all()
    return case, view


def _sinks(seed: int) -> torch.Tensor:
    return torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("window, with_sinks", [(0, False), (12, True), (5, False)])
def test_mixed_batch_on_the_view(window: int, with_sinks: bool) -> None:
    """Prefill rows through the prefill kernel and decode rows unsplit, in one call."""
    case, view = _case(ROWS, seed=window)
    sinks = _sinks(window) if with_sinks else None
    n = case.num_real_tokens
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, SCALE, window, sinks)
    got = tpa.paged_attention(case.query, view, case.meta, SCALE, window=window, sinks=sinks)
    torch.testing.assert_close(got[:n], expected[:n], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("num_splits, fused_reduce", [(1, True), (3, True), (3, False)])
def test_decode_on_the_view(num_splits: int, fused_reduce: bool) -> None:
    rows = [(50, 1), (7, 1), (33, 1)]
    case, view = _case(rows, seed=num_splits)
    sinks = _sinks(1)
    n = case.num_real_tokens
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, SCALE, 20, sinks)
    got = tpa.paged_attention(
        case.query, view, case.meta, SCALE, window=20, sinks=sinks, num_splits=num_splits, fused_reduce=fused_reduce
    )
    torch.testing.assert_close(got[:n], expected[:n], atol=TOL, rtol=TOL)


def test_older_large_row_launch_on_the_view() -> None:
    case, view = _case([(10, 24), (3, 1)], seed=4)
    sinks = _sinks(4)
    n = case.num_real_tokens
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, SCALE, 9, sinks)
    got = tpa.paged_attention(case.query, view, case.meta, SCALE, window=9, sinks=sinks, prefill_kernel=False)
    torch.testing.assert_close(got[:n], expected[:n], atol=TOL, rtol=TOL)


def test_the_gpu_tiles_of_wide_heads_and_the_others_unchanged() -> None:
    assert 512 in TRITON_HEAD_DIMS and attention_backend(torch.device("cpu"), 512, "triton") == "triton"
    assert decode_tiles(512, 8, True) == AttentionTiles(16, 32, 4, 2)
    assert decode_tiles(512, 32, True) == AttentionTiles(32, 32, 4, 2)
    assert prefill_tiles(512, 8, True) == AttentionTiles(32, 32, 8, 2)
    assert default_variant(512, True) == PrefillVariant(32, 32, 8, 2)
    # The tiles of the other head sizes, as fitted before 512 was added (launch_config's docstrings).
    assert decode_tiles(256, 2, True) == AttentionTiles(16, 64, 4, 2)
    assert decode_tiles(128, 8, True) == AttentionTiles(16, 128, 4, 2)
    assert decode_tiles(64, 8, True) == AttentionTiles(16, 128, 4, 3)
    assert prefill_tiles(256, 2, True) == AttentionTiles(64, 32, 4, 2)
    assert prefill_tiles(128, 8, True) == AttentionTiles(128, 128, 8, 3)
    assert default_variant(256, True) == PrefillVariant(64, 32, 4, 2)
    assert default_variant(128, True) == PrefillVariant(128, 128, 8, 3, k_trans=False)
