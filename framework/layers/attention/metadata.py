"""What attention layers need to know about one step's batch, and the waits for KV another tier loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class KVLayerWaits:
    """The forward's waits for the KV a tier outside the device cache (a KV connector) loads this step.

    A model calls `layer(i)` before it stores to or reads paged layer `i` (its position in the model's
    `kv_caches`; a draft model's layers follow the target's), and `all()` before work that reads every layer at
    once. Each makes the forward's stream wait, on the device, for that layer's copies only, so layer 0 can
    start while later layers still load. This base waits for nothing: the metadata of a step with no loads (or
    no connector) carries it (`NO_KV_WAITS`).
    """

    def layer(self, kv_layer: int) -> None:
        """The forward's stream waits until paged layer `kv_layer`'s loaded blocks are in place."""

    def all(self) -> None:
        """The forward's stream waits until every layer's loaded blocks are in place."""


NO_KV_WAITS = KVLayerWaits()  # stateless: shared by every step's metadata


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
    # A KV connector's per-layer waits for this step's loads (framework/kv_transfer): every model calls
    # `kv_waits.layer(i)` before touching paged layer i. Host-side only: CUDA graphs never see it.
    kv_waits: KVLayerWaits = NO_KV_WAITS
