"""What a captured decode graph tells a model state about its batch (shared by the runner and the model states)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class GraphBatch(NamedTuple):
    """What a captured decode graph knows of its batch: static device buffers, padded to the graph's size.

    Their addresses never change, so whatever a state builds from them inside the capture replays correctly
    every step. Rows past the step's real ones are padding: their `idx_mapping` entry is the state's
    `graph_dummy_slot`, so per-slot reads and writes of padding rows touch only that slot.
    """

    num_rows: int  # B: the graph's padded batch size
    tokens_per_row: int  # q: 1, or 1 + k when every row verifies k drafts
    idx_mapping: torch.Tensor  # [B] int32: batch_row -> req_slot (padding rows -> graph_dummy_slot)
    query_start_loc: torch.Tensor  # [B+1] int32: row * q
    token_rows: torch.Tensor  # [B*q] int64: token -> batch_row
