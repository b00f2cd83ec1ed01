"""Block-table gather and KV-slot mapping (references for the GPU kernels of the same names)."""

from __future__ import annotations

import torch

PAD_KV_SLOT = -1  # KV slot of a padding token: stores skip it


def gather_block_tables_reference(
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    block_table: torch.Tensor,  # [S, max_blocks] int32: persistent rows per req_slot
) -> torch.Tensor:
    """[R, max_blocks] int32: this step's block table, one row per batch row."""
    return block_table[idx_mapping.long()]


def compute_kv_slot_mapping_reference(
    token_rows: torch.Tensor,  # [T] int64: batch_row of each token
    positions: torch.Tensor,  # [T] int64
    batch_block_table: torch.Tensor,  # [R, max_blocks] int32
    block_size: int,
    num_padded_tokens: int | None = None,
) -> torch.Tensor:
    """[T_padded] int64: KV slot (`block * block_size + offset`) where each token's K/V is stored.

    Tokens past T (CUDA-graph padding) map to PAD_KV_SLOT.
    """
    block = batch_block_table[token_rows, positions // block_size].long()
    kv_slots = block * block_size + positions % block_size
    if num_padded_tokens is not None and num_padded_tokens > kv_slots.numel():
        pad = kv_slots.new_full((num_padded_tokens - kv_slots.numel(),), PAD_KV_SLOT)
        kv_slots = torch.cat([kv_slots, pad])
    return kv_slots
