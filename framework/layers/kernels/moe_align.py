"""Expert alignment of the fused-MoE kernels: the (token, choice) rows grouped by expert in whole blocks.

`moe_align(topk_ids, E, BLOCK_M)` sorts the `M * K` rows (`row = token * K + choice`, the flattened `topk_ids`
index) by expert, keeping token order within an expert, and pads each expert's run to a multiple of `BLOCK_M`,
so every block of `BLOCK_M` sorted rows belongs to one expert (`framework/layers/kernels/fused_moe.py` launches one
program per block). Static shapes and no host sync, for CUDA-graph capture: the buffers are sized for the worst
case, and the GEMM kernels skip blocks past `num_padded`.

Two implementations with identical outputs: `moe_align_triton` (one program; decode sizes) and
`moe_align_reference` (PyTorch ops around a stable sort; any size, and the semantics).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import next_power_of_2

ALIGN_KERNEL_MAX_ROWS = 4096  # one program scans the rows serially: decode sizes only (see moe_align)
ALIGN_CHUNK = 128  # rows per step of the scan: a [CHUNK, CHUNK] comparison ranks rows of one expert


class MoeAlignment(NamedTuple):
    """Rows sorted by expert, each expert's run padded to whole blocks."""

    sorted_rows: torch.Tensor  # [P] int32 (token, choice) rows; value M * K marks padding
    block_expert: torch.Tensor  # [P // BLOCK_M] int32 expert of each block (blocks past num_padded: unused)
    num_padded: torch.Tensor  # [1] int32 sum over experts of ceil(rows_e / BLOCK_M) * BLOCK_M


def _align_capacity(num_rows: int, num_experts: int, block_m: int) -> int:
    """Blocks for the worst case: at most min(E, N) experts have rows, each wastes under one block."""
    return -(-(num_rows + min(num_experts, num_rows) * (block_m - 1)) // block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the rows of `topk_ids` [M, K] (expert ids, int) by expert in blocks of `block_m` rows.

    Static shapes and no host sync (CUDA-graph capture): P is the worst case `M K + min(E, M K) (block_m - 1)`
    rounded up to a block; each expert's rows stay in token order. Decode-sized inputs take `moe_align_triton`
    (one launch instead of ~30 small PyTorch kernels per layer, which a captured decode step would replay 48
    times); larger ones take `moe_align_reference` (a stable sort), whose launches are noise next to a
    prefill's GEMMs.
    """
    flat = topk_ids.reshape(-1)
    if flat.numel() <= ALIGN_KERNEL_MAX_ROWS:
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align_reference(topk_ids, num_experts, block_m)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """`moe_align_reference` in one Triton program (`_moe_align_kernel`); meant for up to a few thousand rows
    (it scans them serially)."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    num_blocks = _align_capacity(n, num_experts, block_m)
    device = flat.device
    sorted_rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    bins = next_power_of_2(num_experts + 1)
    cursor = torch.empty(bins, dtype=torch.int32, device=device)
    _moe_align_kernel[(1,)](
        flat,
        sorted_rows,
        block_expert,
        num_padded,
        cursor,
        n,
        num_blocks * block_m,
        num_blocks,
        E=num_experts,
        E_BINS=bins,
        BLOCK_M=block_m,
        CHUNK=ALIGN_CHUNK,
        num_warps=8,
    )
    return MoeAlignment(sorted_rows, block_expert, num_padded)


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """`moe_align` in PyTorch ops: a stable sort by expert, then each row's place in its expert's padded run."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # [N = M K] expert of each row
    n = flat.numel()
    device = flat.device
    num_blocks = _align_capacity(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # [N] rows, grouped by expert
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (padded_ends - padded)[sorted_experts] + rank_in_expert
    sorted_rows = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_rows[dest] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return MoeAlignment(sorted_rows, block_expert.to(torch.int32), padded_ends[-1:].to(torch.int32))


@triton.jit(do_not_specialize=["num_rows", "capacity", "num_blocks"])
def _moe_align_kernel(
    ids_ptr,  # [N] int expert of each (token, choice) row
    sorted_rows_ptr,  # [capacity] int32 out: rows grouped by expert, num_rows = padding
    block_expert_ptr,  # [num_blocks] int32 out
    num_padded_ptr,  # [1] int32 out
    cursor_ptr,  # [E_BINS] int32 scratch: next free position of each expert
    num_rows,  # N
    capacity,  # num_blocks * BLOCK_M
    num_blocks,
    E: tl.constexpr,
    E_BINS: tl.constexpr,  # next power of two > E (bin E collects masked rows)
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """`moe_align` in one program: histogram, padded prefix sums, then a stable scatter chunk by chunk."""
    bins = tl.arange(0, E_BINS)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((E_BINS,), dtype=tl.int32)
    for start in range(0, num_rows, CHUNK):
        ids = tl.load(ids_ptr + start + lanes, mask=start + lanes < num_rows, other=E).to(tl.int32)
        counts += tl.histogram(ids, E_BINS)
    padded = tl.where(bins < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for start in range(0, capacity, CHUNK):
        tl.store(
            sorted_rows_ptr + start + lanes,
            tl.zeros((CHUNK,), dtype=tl.int32) + num_rows,
            mask=start + lanes < capacity,
        )
    for start in range(0, num_blocks, CHUNK):  # expert of block b: how many experts' runs end at or before it
        block_start = (start + lanes) * BLOCK_M
        done = (ends[None, :] <= block_start[:, None]) & (bins[None, :] < E)
        expert = tl.minimum(tl.sum(done.to(tl.int32), 1), E - 1)
        tl.store(block_expert_ptr + start + lanes, expert, mask=start + lanes < num_blocks)
    tl.debug_barrier()  # the cursors and the padding are written before the scatter reads / overwrites them
    for start in range(0, num_rows, CHUNK):
        rows = start + lanes
        valid = rows < num_rows
        ids = tl.load(ids_ptr + rows, mask=valid, other=E).to(tl.int32)
        # Rank among the chunk's earlier rows of the same expert: keeps token order within an expert.
        same = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(same.to(tl.int32), 1)
        base = tl.load(cursor_ptr + ids, mask=valid, other=0)
        tl.store(sorted_rows_ptr + base + rank, rows.to(tl.int32), mask=valid)
        tl.debug_barrier()  # every lane read its cursor before the cursors advance
        cursor = tl.load(cursor_ptr + bins)
        tl.store(cursor_ptr + bins, cursor + tl.histogram(ids, E_BINS))
        tl.debug_barrier()
