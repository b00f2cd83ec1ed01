"""Block-table gather and KV-slot mapping (references for the GPU kernels of the same names)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv

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


def group_kv_slot_mapping_reference(
    token_rows: torch.Tensor,  # [T] int64: batch_row of each token
    positions: torch.Tensor,  # [T] int64
    group0_slots: torch.Tensor,  # [T] int64: group 0's KV slot of each token (negative: padding, stores nothing)
    block_tables: torch.Tensor,  # [R, G * M] int32: group g's table in columns g * M .. (g + 1) * M
    num_groups: int,  # G
    block_size: int,
) -> torch.Tensor:
    """[G - 1, T] int64: the KV slot of each token in KV groups 1 .. G - 1 (row g - 1: group g), read from each
    group's columns; PAD_KV_SLOT wherever group 0's slot is negative (a padding token stores in no group)."""
    tables = block_tables.unflatten(1, (num_groups, block_tables.shape[1] // num_groups))[:, 1:]  # [R, G - 1, M]
    blocks = tables[token_rows, :, positions // block_size].long()  # [T, G - 1]
    slots = blocks * block_size + (positions % block_size)[:, None]
    return torch.where(group0_slots[:, None] >= 0, slots, PAD_KV_SLOT).T.contiguous()


# ---- Triton kernels ------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["out_stride", "num_cols"])  # per-step sizes: no recompiles mid-run
def _gather_block_tables_kernel(
    idx_mapping_ptr, table_ptr, table_stride, out_ptr, out_stride, num_cols, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    values = tl.load(table_ptr + slot * table_stride + cols, mask=mask)
    tl.store(out_ptr + row * out_stride + cols, values, mask=mask)


def gather_block_tables_triton(
    idx_mapping: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton version of `gather_block_tables_reference`; `out` [>= R, max_blocks] may be a persistent buffer."""
    rows, cols = idx_mapping.numel(), block_table.shape[1]
    if out is None:
        out = torch.empty(rows, cols, dtype=block_table.dtype, device=block_table.device)
    if rows:
        _gather_block_tables_kernel[(rows, cdiv(cols, 512))](
            idx_mapping, block_table, block_table.stride(0), out, out.stride(0), cols, BLOCK=512
        )
    return out[:rows]


@triton.jit(do_not_specialize=["num_tokens", "num_padded"])  # per-step sizes: no recompiles mid-run
def _kv_slot_mapping_kernel(
    token_rows_ptr,
    positions_ptr,
    table_ptr,
    table_stride,
    out_ptr,
    num_tokens,
    num_padded,
    block_size,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = t < num_tokens
    row = tl.load(token_rows_ptr + t, mask=valid, other=0)
    pos = tl.load(positions_ptr + t, mask=valid, other=0)
    block = tl.load(table_ptr + row * table_stride + pos // block_size, mask=valid, other=0).to(tl.int64)
    kv_slot = tl.where(valid, block * block_size + pos % block_size, -1)
    tl.store(out_ptr + t, kv_slot, mask=t < num_padded)


def compute_kv_slot_mapping_triton(
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    batch_block_table: torch.Tensor,
    block_size: int,
    num_padded_tokens: int | None = None,
) -> torch.Tensor:
    """Triton version of `compute_kv_slot_mapping_reference`."""
    num_tokens = token_rows.numel()
    padded = max(num_padded_tokens or num_tokens, num_tokens)
    out = torch.empty(padded, dtype=torch.int64, device=positions.device)
    if padded:
        _kv_slot_mapping_kernel[(cdiv(padded, 1024),)](
            token_rows,
            positions,
            batch_block_table,
            batch_block_table.stride(0),
            out,
            num_tokens,
            padded,
            block_size,
            BLOCK=1024,
        )
    return out


@triton.jit(do_not_specialize=["num_tokens"])  # per-step sizes: no recompiles mid-run
def _group_kv_slot_mapping_kernel(
    token_rows_ptr,
    positions_ptr,
    group0_slots_ptr,
    table_ptr,
    table_stride,
    group_width,
    out_ptr,
    num_tokens,
    block_size,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    group = tl.program_id(1) + 1  # groups 1 .. G - 1: group 0's slots are the step's own
    valid = t < num_tokens
    stores = valid & (tl.load(group0_slots_ptr + t, mask=valid, other=-1) >= 0)
    row = tl.load(token_rows_ptr + t, mask=stores, other=0)
    pos = tl.load(positions_ptr + t, mask=stores, other=0)
    column = group * group_width + pos // block_size
    block = tl.load(table_ptr + row * table_stride + column, mask=stores, other=0).to(tl.int64)
    kv_slot = tl.where(stores, block * block_size + pos % block_size, -1)
    tl.store(out_ptr + (group - 1).to(tl.int64) * num_tokens + t, kv_slot, mask=valid)


def group_kv_slot_mapping_triton(
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    group0_slots: torch.Tensor,
    block_tables: torch.Tensor,
    num_groups: int,
    block_size: int,
) -> torch.Tensor:
    """Triton version of `group_kv_slot_mapping_reference`: one launch for every group (one per group, plus a
    masking `where` each, before)."""
    num_tokens = positions.numel()
    out = torch.empty(num_groups - 1, num_tokens, dtype=torch.int64, device=positions.device)
    if num_tokens and num_groups > 1:
        _group_kv_slot_mapping_kernel[(cdiv(num_tokens, 1024), num_groups - 1)](
            token_rows,
            positions,
            group0_slots,
            block_tables,
            block_tables.stride(0),
            block_tables.shape[1] // num_groups,
            out,
            num_tokens,
            block_size,
            BLOCK=1024,
        )
    return out


def gather_block_tables(idx_mapping: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Dispatching gather: Triton on CUDA, the reference elsewhere."""
    fn = gather_block_tables_triton if idx_mapping.is_cuda else gather_block_tables_reference
    return fn(idx_mapping, block_table)


def compute_kv_slot_mapping(
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    batch_block_table: torch.Tensor,
    block_size: int,
    num_padded_tokens: int | None = None,
) -> torch.Tensor:
    """Dispatching KV-slot mapping: Triton on CUDA, the reference elsewhere."""
    fn = compute_kv_slot_mapping_triton if positions.is_cuda else compute_kv_slot_mapping_reference
    return fn(token_rows, positions, batch_block_table, block_size, num_padded_tokens)


def group_kv_slot_mapping(
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    group0_slots: torch.Tensor,
    block_tables: torch.Tensor,
    num_groups: int,
    block_size: int,
) -> torch.Tensor:
    """Dispatching per-group KV-slot mapping: Triton on CUDA, the reference elsewhere."""
    fn = group_kv_slot_mapping_triton if positions.is_cuda else group_kv_slot_mapping_reference
    return fn(token_rows, positions, group0_slots, block_tables, num_groups, block_size)
