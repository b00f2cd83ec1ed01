"""V1 input preparation: every per-token array is built on the CPU with NumPy, then copied to the device.

The persistent batch is already in the scheduler's order, so batch row == persistent-batch row and nothing
is gathered through an index mapping. The result is the same `InputBatch` type V2 builds, so the ModelState
and the model cannot tell the runners apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from framework.input_batch import InputBatch
from framework.v1.persistent_batch import PersistentBatch


class StepBlockTables:
    """This step's block-table rows and KV slots, already computed on the CPU, behind the `BlockTables` calls
    a ModelState makes (`gather`, `kv_slot_mapping`, `block_size`).

    V2's `BlockTables` gathers rows by `req_slot` and computes KV slots on the device; V1 has done both in
    NumPy while building the batch, so these calls return the result. They accept only this step's batch.
    """

    def __init__(self, table: torch.Tensor, kv_slots: torch.Tensor, block_size: int, idx_mapping: torch.Tensor) -> None:
        self.table = table  # [R, max_blocks] int32, batch order
        self.kv_slots = kv_slots  # [T] int64
        self.block_size = block_size
        self._idx_mapping = idx_mapping

    def gather(self, idx_mapping: torch.Tensor) -> torch.Tensor:
        """[R, max_blocks] int32: the rows of this step's batch (`idx_mapping` must be the batch's own)."""
        if idx_mapping is not self._idx_mapping:
            raise ValueError("V1 block tables serve only the current step's batch rows")
        return self.table

    def kv_slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor, batch_table: torch.Tensor) -> torch.Tensor:
        """[T] int64 KV slot of each token of this step (computed on the CPU)."""
        if batch_table is not self.table or positions.shape != self.kv_slots.shape:
            raise ValueError("V1 block tables serve only the current step's batch")
        return self.kv_slots


@dataclass(frozen=True)
class StepInputs:
    batch: InputBatch
    block_tables: StepBlockTables
    seq_lens_host: np.ndarray  # [R] int64: KV length of each row after this step


def _to_device(array: np.ndarray, dtype: type, device: torch.device, fresh: bool = True) -> torch.Tensor:
    """Copy a host array to the device. `fresh=False`: a view of persistent rows, copied first on the CPU
    so the step's tensors never alias arrays that later steps change."""
    host = np.ascontiguousarray(array, dtype=dtype) if fresh else np.array(array, dtype=dtype)
    return torch.from_numpy(host).to(device, non_blocking=True)


def build_step_inputs(
    pb: PersistentBatch,
    num_scheduled: list[int],  # [R] tokens per row, in row (= scheduler) order
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """Build rows 0..R-1's inputs on the CPU and copy them; advances `num_computed` of those rows."""
    num_rows = len(num_scheduled)
    rows = np.arange(num_rows)
    counts = np.asarray(num_scheduled, dtype=np.int64)  # [R]
    query_start_loc = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    token_rows = np.repeat(rows, counts)  # [T] batch row of each token
    offsets = np.arange(num_tokens) - query_start_loc[token_rows]
    computed = pb.num_computed[:num_rows]
    positions = computed[token_rows] + offsets  # [T]
    # Sampled tokens were appended to token_ids on the CPU last step, so decode and prefill read alike.
    input_ids = pb.token_ids[token_rows, positions]  # [T]
    seq_lens = computed + counts  # [R]
    pb.num_computed[:num_rows] = seq_lens
    logits_indices = query_start_loc[1:] - 1  # [R] each row's last token
    kv_slots = pb.block_table[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size

    def dev(array: np.ndarray, dtype: type = np.int32) -> torch.Tensor:
        return _to_device(array, dtype, device)

    idx_mapping = _to_device(pb.state_slot[:num_rows], np.int32, device, fresh=False)  # batch row -> ModelState slot
    qsl = dev(query_start_loc)
    positions_dev = dev(positions, np.int64)
    table = _to_device(pb.block_table[:num_rows], np.int32, device, fresh=False)
    batch = InputBatch(
        request_ids=[pb.req_ids[r] for r in range(num_rows)],  # type: ignore[misc]
        num_rows=num_rows,
        num_tokens=num_tokens,
        num_logits=num_rows,
        max_query_len=int(counts.max()),
        max_seq_len=int(seq_lens.max()),
        idx_mapping_host=pb.state_slot[:num_rows].copy(),
        num_draft_host=np.zeros(num_rows, dtype=np.int64),
        idx_mapping=idx_mapping,
        query_start_loc=qsl,
        query_lens=dev(counts),
        num_draft=torch.zeros(num_rows, dtype=torch.int32, device=device),
        cu_num_logits=dev(np.arange(num_rows + 1)),
        token_rows=dev(token_rows, np.int64),
        input_ids=dev(input_ids, np.int64),
        positions=positions_dev,
        seq_lens=dev(seq_lens),
        logits_indices=dev(logits_indices, np.int64),
        expanded_idx_mapping=idx_mapping,
        sample_positions=dev(seq_lens, np.int64),  # the sampled token's position is the row's new length
    )
    block_tables = StepBlockTables(table, dev(kv_slots, np.int64), block_size, idx_mapping)
    return StepInputs(batch, block_tables, seq_lens)
