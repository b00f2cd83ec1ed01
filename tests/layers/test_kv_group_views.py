"""The Triton kernels (interpreter) over a KV group's block table: a column view of the wide [R, G * M] table
(docs/sliding-window.md#models-mixing-window-and-full-layers-kv-groups), whose row stride is G * M. The KV-slot
mapping and the decode, split-decode and prefill attention kernels must read the view as they read a contiguous
table; `group_metadata` must give each group its columns and the KV slots its table names (padding stays -1).
Control: the view of another group's columns changes the attention output."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.attention_cases import make_paged_case

from framework.layers.attention import triton_paged_attention as tpa
from framework.layers.attention import triton_prefill_attention as tpf
from framework.layers.attention.kv_groups import group_metadata
from framework.layers.attention.paged import store_kv_reference
from framework.layers.kernels.block_table import (
    compute_kv_slot_mapping_reference,
    compute_kv_slot_mapping_triton,
    group_kv_slot_mapping_reference,
    group_kv_slot_mapping_triton,
)
from framework.params.kv_groups import kv_group_layout

BLOCK_SIZE = 8
ROWS = [(70, 1), (0, 37), (45, 18), (5, 1)]


def _case_with_wide_table():  # type: ignore[no-untyped-def]
    """A paged case whose table is group 1 of a 3-group wide table (groups 0 and 2: other valid block ids)."""
    case = make_paged_case(
        ROWS, num_heads=4, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE, dtype=torch.float32, num_pad_tokens=3
    )
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)  # this step's K/V
    table = case.meta.block_tables
    num_blocks = case.kv_cache.shape[1]
    others = torch.randint(0, num_blocks, (2, *table.shape), generator=torch.Generator().manual_seed(3))
    wide = torch.cat([others[0].to(table.dtype), table, others[1].to(table.dtype)], dim=1)
    width = table.shape[1]
    return case, wide, width


@pytest.mark.parametrize("kwargs", [{}, {"num_splits": 2, "fused_reduce": True}], ids=["decode", "split"])
def test_attention_reads_a_group_view_as_a_contiguous_table(kwargs: dict) -> None:
    case, wide, width = _case_with_wide_table()
    view = replace(case.meta, block_tables=wide[:, width : 2 * width])
    assert view.block_tables.stride(0) == 3 * width
    expected = tpa.paged_attention(case.query, case.kv_cache, case.meta, 0.2, window=12, **kwargs)
    actual = tpa.paged_attention(case.query, case.kv_cache, view, 0.2, window=12, **kwargs)
    n = case.num_real_tokens
    torch.testing.assert_close(actual[:n], expected[:n])
    wrong = replace(case.meta, block_tables=wide[:, :width])  # control: group 0's columns
    other = tpa.paged_attention(case.query, case.kv_cache, wrong, 0.2, window=12, **kwargs)
    assert not torch.allclose(other[:n], expected[:n], atol=1e-2)  # other blocks (NaN where unwritten)


def test_prefill_kernel_reads_a_group_view() -> None:
    case, wide, width = _case_with_wide_table()
    view = replace(case.meta, block_tables=wide[:, width : 2 * width])
    variant = tpf.PrefillVariant.parse("block_n=16", tpf.default_variant(16, on_gpu=False))
    expected = tpa.paged_attention(case.query, case.kv_cache, case.meta, 0.2, window=21, prefill_variant=variant)
    actual = tpa.paged_attention(case.query, case.kv_cache, view, 0.2, window=21, prefill_variant=variant)
    n = case.num_real_tokens
    torch.testing.assert_close(actual[:n], expected[:n])


def test_group_metadata_gives_each_group_its_columns_and_slots() -> None:
    case, wide, width = _case_with_wide_table()
    lens = [q for _, q in ROWS]
    token_rows = torch.repeat_interleave(torch.arange(len(ROWS)), torch.tensor(lens))
    positions = torch.cat([torch.arange(c, c + q) for c, q in ROWS])
    n = case.num_real_tokens
    pad = case.meta.num_tokens - n
    positions = torch.cat([positions, torch.zeros(pad, dtype=positions.dtype)])
    group0_slots = compute_kv_slot_mapping_reference(token_rows, positions[:n], wide[:, :width], BLOCK_SIZE, n + pad)
    meta = replace(case.meta, block_tables=wide, kv_slot_mapping=group0_slots)
    layout = kv_group_layout([0, 12, 24])
    assert layout is not None and layout.num_groups == 3
    metas = group_metadata(meta, positions, layout)
    for group, group_meta in enumerate(metas):
        table = wide[:, group * width : (group + 1) * width]
        assert torch.equal(group_meta.block_tables, table)
        expected = compute_kv_slot_mapping_reference(token_rows, positions[:n], table, BLOCK_SIZE)
        assert torch.equal(group_meta.kv_slot_mapping[:n], expected)
        assert (group_meta.kv_slot_mapping[n:] == -1).all()
    assert group_metadata(meta, positions, None)[0] is meta


def test_slot_mapping_kernel_reads_a_group_view() -> None:
    _, wide, width = _case_with_wide_table()
    token_rows = torch.tensor([0, 1, 1, 2, 3], dtype=torch.int64)
    positions = torch.tensor([70, 0, 36, 50, 5], dtype=torch.int64)
    view = wide[:, 2 * width :]
    expected = compute_kv_slot_mapping_reference(token_rows, positions, view, BLOCK_SIZE, 7)
    torch.testing.assert_close(compute_kv_slot_mapping_triton(token_rows, positions, view, BLOCK_SIZE, 7), expected)


def test_every_groups_slots_in_one_launch_equal_each_groups_own() -> None:
    """`group_kv_slot_mapping` (reference and Triton kernel) equals, row g - 1, the slot map computed from group
    g's columns alone, with -1 wherever group 0's slot is -1 (padding: mid-batch and at the end)."""
    _, wide, width = _case_with_wide_table()
    token_rows = torch.tensor([0, 1, 1, 2, 3, 0, 2], dtype=torch.int64)
    positions = torch.tensor([70, 0, 36, 50, 5, 0, 61], dtype=torch.int64)
    group0 = compute_kv_slot_mapping_reference(token_rows, positions, wide[:, :width], BLOCK_SIZE)
    group0[5] = -1  # a padding token inside the step (a dummy row's): stores in no group
    expected = torch.stack(
        [
            torch.where(
                group0 >= 0,
                compute_kv_slot_mapping_reference(
                    token_rows, positions, wide[:, g * width : (g + 1) * width], BLOCK_SIZE
                ),
                -1,
            )
            for g in (1, 2)
        ]
    )
    reference = group_kv_slot_mapping_reference(token_rows, positions, group0, wide, 3, BLOCK_SIZE)
    triton_out = group_kv_slot_mapping_triton(token_rows, positions, group0, wide, 3, BLOCK_SIZE)
    assert torch.equal(reference, expected) and torch.equal(triton_out, expected)
    assert (expected[:, 5] == -1).all() and (expected >= 0).sum() == 12
