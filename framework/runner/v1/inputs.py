"""V1 input preparation: every per-token array is built on the CPU with NumPy, then copied to the device.

The persistent batch is already in the scheduler's order, so batch row == persistent-batch row and nothing
is gathered through an index mapping. The result is the same `InputBatch` type V2 builds, so the ModelState
and the model cannot tell the runners apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from framework.batch.input_batch import InputBatch
from framework.runner.v1.persistent_batch import PersistentBatch


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

    def kv_slot_mapping(
        self, token_rows: torch.Tensor, positions: torch.Tensor, batch_table: torch.Tensor
    ) -> torch.Tensor:
        """[T] int64 KV slot of each token of this step (computed on the CPU)."""
        if batch_table is not self.table or positions.shape != self.kv_slots.shape:
            raise ValueError("V1 block tables serve only the current step's batch")
        return self.kv_slots


@dataclass(frozen=True)
class StepInputs:
    batch: InputBatch
    block_tables: StepBlockTables
    seq_lens_host: np.ndarray  # [R] int64: KV length of each row after this step


class HostToDevice:
    """Copies this step's host arrays to the device through pinned buffers on CUDA: one array (`__call__`), or
    every input of a step packed into one buffer and sent in one copy (`many`).

    The buffers are reused every step. That is safe only because V1 is synchronous: `sample_tokens` waits
    for the device, so no copy of the previous step still reads a buffer when the next step refills it.
    """

    ALIGN = 16  # bytes: every packed part starts aligned, so its device view of any dtype is valid

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: dict[str, torch.Tensor] = {}

    def many(self, arrays: dict[str, tuple[np.ndarray, type]]) -> dict[str, torch.Tensor]:
        """name -> (array, dtype) to name -> device tensor of that dtype and shape. On CUDA the arrays share
        one pinned byte buffer and one host-to-device copy (a step's dozen inputs cost one copy's launch); on the
        CPU each is copied as by `__call__(fresh=False)`."""
        if self.device.type != "cuda":
            return {name: self(name, array, dtype, fresh=False) for name, (array, dtype) in arrays.items()}
        hosts = {name: np.ascontiguousarray(array, dtype=dtype) for name, (array, dtype) in arrays.items()}
        offsets, total = pack_layout(hosts, self.ALIGN)
        buffer = self._pinned.get("many")
        if buffer is None or buffer.numel() < total:
            buffer = torch.empty(
                max(total, 2 * (buffer.numel() if buffer is not None else 0), 1), dtype=torch.uint8, pin_memory=True
            )
            self._pinned["many"] = buffer
        pack(hosts, offsets, buffer.numpy())
        return unpack(buffer[:total].to(self.device, non_blocking=True), hosts, offsets)

    def __call__(self, name: str, array: np.ndarray, dtype: type, fresh: bool = True) -> torch.Tensor:
        """`fresh=False` for a view of persistent rows: on the CPU it is copied, so the step's tensors never
        alias arrays that later steps change."""
        if self.device.type != "cuda":
            host = np.asarray(array, dtype=dtype) if fresh else np.array(array, dtype=dtype)
            return torch.from_numpy(np.ascontiguousarray(host))
        host = np.asarray(array, dtype=dtype)  # copied into the pinned buffer below: no aliasing
        buffer = self._pinned.get(name)
        if buffer is None or buffer.numel() < host.size:
            capacity = max(host.size, 2 * (buffer.numel() if buffer is not None else 0), 1)
            buffer = torch.empty(capacity, dtype=torch.from_numpy(host[:0].ravel()).dtype, pin_memory=True)
            self._pinned[name] = buffer
        staged = buffer[: host.size]
        staged.numpy()[...] = host.ravel()
        return staged.view(host.shape).to(self.device, non_blocking=True)


def pack_layout(hosts: dict[str, np.ndarray], align: int) -> tuple[dict[str, int], int]:
    """(byte offset of each array, total bytes) when the arrays are packed one after another, each part
    starting at a multiple of `align`."""
    offsets, total = {}, 0
    for name, host in hosts.items():
        offsets[name] = total
        total += -(-host.nbytes // align) * align
    return offsets, total


def pack(hosts: dict[str, np.ndarray], offsets: dict[str, int], staged: np.ndarray) -> None:
    """Write each (C-contiguous) array's bytes into the uint8 buffer `staged` at its offset."""
    for name, host in hosts.items():
        staged[offsets[name] : offsets[name] + host.nbytes] = host.reshape(-1).view(np.uint8)


def unpack(packed: torch.Tensor, hosts: dict[str, np.ndarray], offsets: dict[str, int]) -> dict[str, torch.Tensor]:
    """Views of the uint8 tensor `packed` (on any device) with each array's dtype and shape."""
    return {
        name: packed[offsets[name] : offsets[name] + host.nbytes]
        .view(torch.from_numpy(host[:0].reshape(-1)).dtype)
        .view(host.shape)
        for name, host in hosts.items()
    }


def build_step_inputs(
    pb: PersistentBatch,
    num_scheduled: list[int],  # [R] tokens per row, in row (= scheduler) order
    block_size: int,
    to_device: HostToDevice,
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
    kv_slots = (
        pb.block_table[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )

    dev = to_device.many(
        {
            "idx_mapping": (pb.state_slot[:num_rows], np.int32),  # batch row -> the request's stable slot
            "block_table": (pb.block_table[:num_rows], np.int32),
            "query_start_loc": (query_start_loc, np.int32),
            "query_lens": (counts, np.int32),
            "num_draft": (np.zeros(num_rows), np.int32),
            "cu_num_logits": (np.arange(num_rows + 1), np.int32),
            "token_rows": (token_rows, np.int64),
            "input_ids": (input_ids, np.int64),
            "positions": (positions, np.int64),
            "seq_lens": (seq_lens, np.int32),
            "logits_indices": (logits_indices, np.int64),
            "kv_slots": (kv_slots, np.int64),
            "sample_positions": (seq_lens, np.int64),  # the sampled token's position is the row's new length
        }
    )
    idx_mapping, table = dev["idx_mapping"], dev["block_table"]
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
        query_start_loc=dev["query_start_loc"],
        query_lens=dev["query_lens"],
        num_draft=dev["num_draft"],
        cu_num_logits=dev["cu_num_logits"],
        token_rows=dev["token_rows"],
        input_ids=dev["input_ids"],
        positions=dev["positions"],
        seq_lens=dev["seq_lens"],
        logits_indices=dev["logits_indices"],
        expanded_idx_mapping=idx_mapping,
        sample_positions=dev["sample_positions"],
    )
    block_tables = StepBlockTables(table, dev["kv_slots"], block_size, idx_mapping)
    return StepInputs(batch, block_tables, seq_lens)
