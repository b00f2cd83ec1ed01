"""The launch order of a large decode batch: its rows by descending KV length (`AttentionMetadata.row_order`).

A stable sort (ties keep batch order), computed once per forward on the device. `torch.argsort` of 256 int32
values took 26 us on an H200 (a radix sort in one block, four passes); the kernel here ranks every row against
every other in one launch: row i's place is the number of rows longer than it, plus the equally long rows
before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv

BLOCK_ROWS = 128  # rows a program places (and rows compared per step of its loop)


def rows_longest_first_reference(seq_lens: torch.Tensor) -> torch.Tensor:
    """[R] int32: the rows by descending `seq_lens` [R], ties in batch order."""
    return torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)


@triton.jit(do_not_specialize=["num_rows"])  # the batch size changes every step: one variant
def _rows_longest_first_kernel(
    seq_lens_ptr,  # [R] int32
    order_ptr,  # [R] int32, out: order[place of row i] = i
    num_rows,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < num_rows
    lens = tl.load(seq_lens_ptr + rows, mask=valid, other=0)
    place = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_rows, BLOCK):
        others = start + tl.arange(0, BLOCK)
        other_lens = tl.load(seq_lens_ptr + others, mask=others < num_rows, other=-1)  # -1: never longer
        before = (other_lens[None, :] > lens[:, None]) | (
            (other_lens[None, :] == lens[:, None]) & (others[None, :] < rows[:, None])
        )
        place += tl.sum(before.to(tl.int32), axis=1)
    tl.store(order_ptr + place, rows, mask=valid)


def rows_longest_first_triton(seq_lens: torch.Tensor) -> torch.Tensor:
    """`rows_longest_first_reference` in one launch (grid: blocks of `BLOCK_ROWS` rows)."""
    num_rows = seq_lens.shape[0]
    order = torch.empty(num_rows, dtype=torch.int32, device=seq_lens.device)
    if num_rows:
        _rows_longest_first_kernel[(cdiv(num_rows, BLOCK_ROWS),)](
            seq_lens.to(torch.int32), order, num_rows, BLOCK=BLOCK_ROWS, num_warps=4
        )
    return order


def rows_longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """[R] int32 rows by descending KV length on `seq_lens`' device: the kernel on a GPU, else the reference."""
    if seq_lens.device.type == "cuda":
        return rows_longest_first_triton(seq_lens)
    return rows_longest_first_reference(seq_lens)
