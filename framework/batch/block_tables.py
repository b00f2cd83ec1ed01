"""Persistent block-table rows per req_slot, gathered into this step's batch order."""

from __future__ import annotations

import numpy as np
import torch

from framework.batch.staged_writes import StagedWrites
from framework.layers.kernels.block_table import compute_kv_slot_mapping, gather_block_tables


class BlockTables:
    """Row `req_slot` lists the KV blocks of the request in that slot, in position order.

    Rows never move; a request gaining blocks appends to its row (staged, applied once per step). Row
    `max_num_reqs` belongs to no request: the padding rows of full-step graphs read it (their KV stores are
    skipped).
    """

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.table = torch.zeros(max_num_reqs + 1, max_blocks_per_req, dtype=torch.int32, device=device)
        self.num_blocks = np.zeros(max_num_reqs + 1, dtype=np.int64)  # host: where the next block goes
        self._staged = StagedWrites(self.table)

    def add_request(self, req_slot: int, block_ids: list[int]) -> None:
        """Overwrite the slot's row with the request's blocks."""
        self.num_blocks[req_slot] = 0
        self.append_blocks(req_slot, block_ids)

    def append_blocks(self, req_slot: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[req_slot])
        if start + len(block_ids) > self.max_blocks_per_req:
            raise RuntimeError(f"slot {req_slot} would hold more than {self.max_blocks_per_req} blocks")
        self._staged.stage(req_slot, block_ids, column=start)
        self.num_blocks[req_slot] = start + len(block_ids)

    def remove_request(self, req_slot: int) -> None:
        self.num_blocks[req_slot] = 0

    def apply_staged_writes(self) -> None:
        self._staged.apply()

    def gather(self, idx_mapping: torch.Tensor) -> torch.Tensor:
        """[R, max_blocks] int32 rows in batch order."""
        return gather_block_tables(idx_mapping, self.table)

    def kv_slot_mapping(
        self, token_rows: torch.Tensor, positions: torch.Tensor, batch_table: torch.Tensor
    ) -> torch.Tensor:
        """[T] int64 KV slot of each token."""
        return compute_kv_slot_mapping(token_rows, positions, batch_table, self.block_size)
