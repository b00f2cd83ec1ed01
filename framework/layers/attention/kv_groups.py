"""One step's attention metadata per KV group (`framework.params.kv_groups`).

With KV groups the runner's block table row of a request is wide: group `g` owns columns `g * M .. (g + 1) * M`
(M = blocks per request), and the step's `kv_slot_mapping` is group 0's. A group's metadata is the same step with
its columns as the block table (a view: CUDA graphs replay it at the same addresses) and its own KV slots,
computed from its table for every token group 0 stores (a padding token, slot -1, stays -1 in every group): every
group's slots in one launch (`group_kv_slot_mapping`), so a forward costs four small launches however many groups.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from framework.layers.attention.metadata import AttentionMetadata
from framework.layers.kernels.block_table import group_kv_slot_mapping
from framework.params.kv_groups import KVGroupLayout


def group_metadata(
    meta: AttentionMetadata,
    positions: torch.Tensor,  # [T] int64
    layout: Optional[KVGroupLayout],
) -> tuple[AttentionMetadata, ...]:
    """The metadata of every KV group, in group order (`(meta,)` without groups). `meta.block_tables` is
    [R, G * M] int32 (every group's columns); each group's is its [R, M] view."""
    if layout is None:
        return (meta,)
    num_groups = layout.num_groups
    width = meta.block_tables.shape[1] // num_groups
    tokens = torch.arange(meta.num_tokens, dtype=meta.query_start_loc.dtype, device=positions.device)
    token_rows = torch.searchsorted(meta.query_start_loc[1:], tokens, right=True)  # [T] batch_row of each token
    token_rows.clamp_(max=max(meta.num_rows - 1, 0))  # padding past the last row: its slot stays -1 below
    # [G - 1, T] int64, one launch for every group (each row contiguous: the store kernels read it as a [T] slot map)
    slots = group_kv_slot_mapping(
        token_rows, positions, meta.kv_slot_mapping, meta.block_tables, num_groups, meta.block_size
    )
    metas = [replace(meta, block_tables=meta.block_tables[:, :width])]
    for group in range(1, num_groups):
        table = meta.block_tables[:, group * width : (group + 1) * width]  # [R, M] view
        metas.append(replace(meta, block_tables=table, kv_slot_mapping=slots[group - 1]))
    return tuple(metas)
