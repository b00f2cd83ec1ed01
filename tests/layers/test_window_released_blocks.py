"""The Triton paged-attention kernels (interpreter) over KV blocks a sliding window released
(docs/sliding-window.md#kv-memory): the scheduler gives back every block wholly before the window of a row's first
query, and another request may overwrite it. A KV tile that starts before the window can still cover such a block
(tiles of 16 or 32 keys over 8-token pages here): its keys are loaded and masked, so any finite content there must
leave the output unchanged. Control: overwriting the first block the window still reads changes the output.
"""

from __future__ import annotations

import pytest
import torch
from helpers.attention_cases import PagedCase, make_paged_case

from framework.layers.attention import triton_paged_attention as tpa
from framework.layers.attention import triton_prefill_attention as tpf
from framework.layers.attention.paged import paged_attention_reference, store_kv_reference

BLOCK_SIZE = 8
# (cached context_len, query_len) per row: decode rows far past the window, prefill chunks inside and past it.
ROWS = [(70, 1), (0, 37), (45, 18), (30, 3), (5, 1), (100, 20)]


def _case(rows: list[tuple[int, int]], seed: int) -> PagedCase:
    case = make_paged_case(
        rows, num_heads=4, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE, dtype=torch.float32, seed=seed
    )
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    return case


def _overwrite_released(case: PagedCase, rows: list[tuple[int, int]], window: int, extra: int = 0) -> int:
    """Large finite random K/V in every block the scheduler would have released (`extra` more blocks: the
    planted fault); returns how many blocks were overwritten."""
    gen, count = torch.Generator().manual_seed(1), 0
    for row, (context, query_len) in enumerate(rows):
        if query_len == 0:
            continue
        for page in range(max(context - window + 1, 0) // BLOCK_SIZE + extra):
            block = case.kv_cache[:, int(case.meta.block_tables[row, page])]
            block.copy_(100 * torch.randn(block.shape, generator=gen))
            count += 1
    return count


def _run(rows: list[tuple[int, int]], window: int, extra: int = 0, **kwargs) -> float:  # type: ignore[no-untyped-def]
    """max |kernel over released blocks - reference over intact ones|."""
    case = _case(rows, seed=window)
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, 0.2, window)
    assert _overwrite_released(case, rows, window, extra) > 0
    actual = tpa.paged_attention(case.query, case.kv_cache, case.meta, 0.2, window=window, **kwargs)
    n = case.num_real_tokens
    assert not actual[:n].isnan().any()
    return (actual[:n] - expected[:n]).abs().max().item()


@pytest.mark.parametrize("window", [12, 21])
def test_mixed_batch_ignores_released_blocks(window: int) -> None:
    assert _run(ROWS, window) < 1e-4


def test_split_decode_ignores_released_blocks() -> None:
    assert _run([(120, 1), (64, 1), (47, 2)], 13, num_splits=2, fused_reduce=True) < 1e-4


def test_prefill_tiles_of_32_ignore_released_blocks() -> None:
    variant = tpf.PrefillVariant.parse("block_n=32", tpf.default_variant(32, on_gpu=False))
    assert _run([(0, 50), (40, 33)], 21, prefill_variant=variant) < 1e-4


def test_planted_fault_a_block_the_window_reads_changes_the_output() -> None:
    assert _run(ROWS, 12, extra=1) > 1e-2
