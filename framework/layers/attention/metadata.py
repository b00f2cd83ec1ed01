"""What attention layers need to know about one step's batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, one row per batch row (built by the ModelState from the InputBatch)."""

    num_tokens: int  # T
    num_rows: int  # R
    query_start_loc: torch.Tensor  # [R+1] int32: first token of each row
    seq_lens: torch.Tensor  # [R] int32: KV length of each row after this step
    block_tables: torch.Tensor  # [R, max_blocks] int32: this step's block table rows
    kv_slot_mapping: torch.Tensor  # [T] int64: KV slot where each token's K/V goes
    block_size: int
    max_query_len: int  # CPU-known bounds, so kernels can size grids without a sync
    max_seq_len: int
    # [R] int32, a permutation of the rows: the order their decode programs start in (None: batch order). The
    # model sets it, rows by descending seq_len, for large batches (backend.order_rows_longest_first, row_order.py).
    row_order: Optional[torch.Tensor] = None
