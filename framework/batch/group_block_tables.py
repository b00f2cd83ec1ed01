"""Block-table rows of a model with KV groups (`framework.params.kv_groups`): one table per group, side by side."""

from __future__ import annotations

import torch

from framework.batch.block_tables import BlockTables
from framework.params.kv_groups import KVGroupLayout


class GroupedBlockTables(BlockTables):
    """`BlockTables` whose row `req_slot` holds every KV group's blocks: group `g` in columns
    `g * M .. (g + 1) * M` (M = `blocks_per_group`), so the gather, the CUDA graphs' static table and the
    attention metadata carry all groups in one [R, G * M] tensor (each layer reads its group's view,
    `layers.attention.kv_groups.group_metadata`).

    Block ids arrive interleaved, as the scheduler's grouped KV manager lists them (`GroupedKVCacheManager`):
    position block `j` of group `g` is entry `j * G + g`. `num_blocks[req_slot]` counts position blocks (each
    is one block per group), so the KV positions a row holds are `num_blocks * block_size` as without groups.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        layout: KVGroupLayout,
    ) -> None:
        self.num_groups = layout.num_groups
        self.blocks_per_group = max_blocks_per_req
        super().__init__(max_num_reqs, max_blocks_per_req * self.num_groups, block_size, device)

    def append_blocks(self, req_slot: int, block_ids: list[int]) -> None:
        """Append interleaved ids (`len(block_ids)` a multiple of the number of groups) to each group's columns."""
        if not block_ids:
            return
        groups = self.num_groups
        if len(block_ids) % groups:
            raise RuntimeError(f"slot {req_slot}: {len(block_ids)} block ids are not one per KV group per block")
        start = int(self.num_blocks[req_slot])
        added = len(block_ids) // groups
        if start + added > self.blocks_per_group:
            raise RuntimeError(f"slot {req_slot} would hold more than {self.blocks_per_group} blocks per KV group")
        for group in range(groups):
            self._staged.stage(req_slot, block_ids[group::groups], column=group * self.blocks_per_group + start)
        self.num_blocks[req_slot] = start + added

    def kv_slot_mapping(
        self, token_rows: torch.Tensor, positions: torch.Tensor, batch_table: torch.Tensor
    ) -> torch.Tensor:
        """[T] int64 KV slot of each token in group 0 (`group_metadata` derives the other groups')."""
        return super().kv_slot_mapping(token_rows, positions, batch_table[:, : self.blocks_per_group])
