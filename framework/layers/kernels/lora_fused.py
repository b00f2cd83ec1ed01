"""LoRA over rows grouped by adapter: the shrink and the expand fused in one launch per projection group.

The step's tokens sorted by adapter slot, once per step (`lora_segments`, on the host; `LoraTokens` sends it with
the token map): `sorted_rows [>= A]` int32 holds the token rows (batch row index space) of every token with an
adapter, slot 0's first, each slot's in token order; `slot_bounds [L + 1]` int32: slot s's rows are
`sorted_rows[slot_bounds[s] : slot_bounds[s + 1]]` (positions into sorted_rows, not token rows). Tokens without an
adapter are in no segment, so nothing reads or writes their rows.

`lora_shrink_expand_triton`: `y[t] += (x[t] @ A[s]^T) @ B[s]^T` for each token t of slot s in ONE launch: a
program per (slot, tile of `block_m` rows of the slot's segment, column tile of y) gathers its rows of x through
`sorted_rows`, computes their float32 `xa = x @ A^T` over all of K, then its `[block_m, block_n]` slice of
`xa @ B^T`, added into y at the same rows. xa is recomputed by every column tile of a row tile (x and A stay in L2);
`block_n` wide tiles keep that repeat small. With a `LoraPartLayout` (merged q/k/v, gate/up) a column tile stays
inside one part and computes only that part's R columns of xa (A rows `p*R .. p*R+R-1`).

The grid is `(L, cdiv(T, block_m), column tiles)` whatever the adapter mix: programs past their slot's segment exit
at once, so a CUDA graph captured at one token count serves any mix. Rows read from `sorted_rows` at or past T are
masked (a forward smaller than the step that wrote the layout, such as a warm-up, reads nothing out of bounds).

The unfused pair over the same layout (`lora_shrink_sorted_triton` + `lora_expand_sorted_triton`) has the same
grid without the column dimension for the shrink: the benchmark compares it to the fused launch (launch count) and
to the slot-masked segment kernels of `lora.py` (work repeated per slot).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from framework.layers.kernels.backend import triton_enabled
from framework.layers.kernels.launch_math import cdiv
from framework.layers.kernels.lora import (
    FUSED_BLOCK_N,
    LoraPartLayout,
    _block_r,
    _check_parts,
    _dot_options,
    _expand_columns,
    lora_expand_reference,
    lora_shrink_reference,
)

# Token counts up to which `LoraGroup.add` takes the fused launch instead of the shrink + expand pair: 0 (off)
# until the kernel benchmark on a GPU shows where it wins (docs/lora.md "Speed").
FUSED_MAX_TOKENS = 0
FUSED_BLOCK_M = 16  # sorted rows per program (tl.dot's smallest tile: a decode batch gives a slot few rows)
FUSED_BLOCK_K = 64  # K columns per loop step of the shrink
SORTED_BLOCK_N = 64  # output columns per program of the unfused sorted expand


def lora_segments(token_lora: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted_rows [A] int32, slot_bounds [num_slots + 1] int32) of a token -> slot map ([T] int32, -1 none):
    the A tokens with an adapter, stably sorted by slot, and each slot's start in that order (its end: the next)."""
    token_lora = np.asarray(token_lora, dtype=np.int32)
    has = np.flatnonzero(token_lora >= 0)
    sorted_rows = has[np.argsort(token_lora[has], kind="stable")].astype(np.int32)
    counts = np.bincount(token_lora[has], minlength=num_slots)[:num_slots]
    slot_bounds = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(counts, out=slot_bounds[1:])
    return sorted_rows, slot_bounds


def lora_segments_of(token_lora: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora_segments` of a tensor, as tensors on its device (reads it on the host: tests and benchmarks only)."""
    rows, bounds = lora_segments(token_lora.cpu().numpy(), num_slots)
    device = token_lora.device
    return torch.from_numpy(rows).to(device), torch.from_numpy(bounds).to(device)


def _check_segments(stacked: torch.Tensor, slot_bounds: torch.Tensor) -> None:
    if slot_bounds.shape[0] != stacked.shape[0] + 1:  # A or B: [L, ...]
        raise ValueError(f"slot_bounds has {slot_bounds.shape[0]} entries, expected {stacked.shape[0] + 1} (slots + 1)")


# ---- reference -----------------------------------------------------------------------------------------


def lora_shrink_expand_reference(
    y: torch.Tensor,  # [T, N] written in place
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [L, P*R, K]
    lora_b: torch.Tensor,  # [L, N, R]
    token_lora: torch.Tensor,  # [T] int32: adapter slot of each token, -1 = none
    parts: Optional[LoraPartLayout] = None,
) -> None:
    """The unfused composition: `lora_shrink_reference` then `lora_expand_reference` (float32 xa)."""
    lora_expand_reference(y, lora_shrink_reference(x, lora_a, token_lora), lora_b, token_lora, parts)


# ---- Triton kernels ------------------------------------------------------------------------------------


@triton.jit
def _segment_rows(rows_ptr, bounds_ptr, slot, tile, T, BLOCK_M: tl.constexpr):
    """This program's token rows (row tile `tile` of slot `slot`'s segment), which are live, and whether any is."""
    seg_end = tl.load(bounds_ptr + slot + 1)
    first = tl.load(bounds_ptr + slot) + tile * BLOCK_M
    pos = first + tl.arange(0, BLOCK_M)
    live = pos < seg_end
    rows = tl.load(rows_ptr + pos, mask=live, other=0)
    live = live & (rows >= 0) & (rows < T)
    return rows, live, first < seg_end


@triton.jit
def _shrink_rows(
    x_ptr, a_ptr, rows, live, slot, a_row, K, R, stride_xt, stride_al, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, BLOCK_R] float32: the rows' x @ A[slot, a_row : a_row + R]^T over all of K."""
    ranks = tl.arange(0, BLOCK_R)
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :], mask=live[:, None] & (ks[None, :] < K), other=0.0)
        a_ptrs = a_ptr + slot * stride_al + (a_row + ranks[None, :]) * stride_ar + ks[:, None]
        a = tl.load(a_ptrs, mask=(ranks[None, :] < R) & (ks[:, None] < K), other=0.0).to(x.dtype)  # [BLOCK_K, R]
        if UPCAST:  # interpreter only: its bfloat16 tl.dot is wrong (interpreter_upcast)
            x, a = x.to(tl.float32), a.to(tl.float32)
        xa = tl.dot(x, a, xa, input_precision=PRECISION)
    return xa


@triton.jit
def _expand_rows(
    y_ptr, b_ptr, xa, rows, live, slot, cols, end, rank_first, R, stride_yt, stride_bl, stride_bn,
    BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """y[rows, cols] += xa[:, rank_first : rank_first + R] @ B[slot, cols]^T (xa [BLOCK_M, BLOCK_R] float32,
    rounded to B's dtype for the dot): B's tile is placed at xa's columns of this part, zero elsewhere."""
    ranks = tl.arange(0, BLOCK_R)
    b_ptrs = b_ptr + slot * stride_bl + cols[None, :] * stride_bn + (ranks[:, None] - rank_first)
    mine = (ranks[:, None] >= rank_first) & (ranks[:, None] < rank_first + R)
    b = tl.load(b_ptrs, mask=(cols[None, :] < end) & mine, other=0.0)  # [BLOCK_R, BLOCK_N]
    xa = xa.to(b.dtype)
    if UPCAST:
        xa, b = xa.to(tl.float32), b.to(tl.float32)
    acc = tl.dot(xa, b, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] float32
    y_ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    keep = live[:, None] & (cols[None, :] < end)
    y = tl.load(y_ptrs, mask=keep, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=keep)


@triton.jit
def _lora_fused_segment_kernel(
    y_ptr, x_ptr, a_ptr, b_ptr, rows_ptr, bounds_ptr, tiles_ptr, T, K, N, R, A_ROWS, COL_TILES,
    stride_yt, stride_xt, stride_al, stride_ar, stride_bl, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_RA: tl.constexpr,
    BLOCK_K: tl.constexpr, TILES: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    slot, tile, col_group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, live, any_row = _segment_rows(rows_ptr, bounds_ptr, slot, tile, T, BLOCK_M)
    if not any_row:  # past this slot's segment: read no weight
        return
    if TILES == 1:  # one column tile: only its part's R columns of xa
        cols, end, xa_col = _expand_columns(tiles_ptr, col_group, N, R, BLOCK_N, PARTS)
        xa = _shrink_rows(
            x_ptr, a_ptr, rows, live, slot, xa_col, K, R, stride_xt, stride_al, stride_ar,
            BLOCK_M, BLOCK_R, BLOCK_K, UPCAST, PRECISION,
        )  # fmt: skip
        _expand_rows(y_ptr, b_ptr, xa, rows, live, slot, cols, end, 0, R, stride_yt, stride_bl, stride_bn,
                     BLOCK_R, UPCAST, PRECISION)  # fmt: skip
    else:  # TILES column tiles, maybe of several parts: every part's xa (all A_ROWS of A) once, reused by each
        xa = _shrink_rows(
            x_ptr, a_ptr, rows, live, slot, 0, K, A_ROWS, stride_xt, stride_al, stride_ar,
            BLOCK_M, BLOCK_RA, BLOCK_K, UPCAST, PRECISION,
        )  # fmt: skip
        for i in range(TILES):
            col_tile = col_group * TILES + i
            if col_tile < COL_TILES:  # the last group may hold fewer tiles
                cols, end, xa_col = _expand_columns(tiles_ptr, col_tile, N, R, BLOCK_N, PARTS)
                _expand_rows(y_ptr, b_ptr, xa, rows, live, slot, cols, end, xa_col, R, stride_yt, stride_bl,
                             stride_bn, BLOCK_RA, UPCAST, PRECISION)  # fmt: skip


@triton.jit
def _lora_shrink_sorted_kernel(
    x_ptr, a_ptr, rows_ptr, bounds_ptr, out_ptr, T, K, R,
    stride_xt, stride_al, stride_ar, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # one program per (slot, row tile, part): R columns of xa, the part's rank block of A
    slot, tile, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, live, any_row = _segment_rows(rows_ptr, bounds_ptr, slot, tile, T, BLOCK_M)
    if not any_row:
        return
    xa = _shrink_rows(
        x_ptr, a_ptr, rows, live, slot, part * R, K, R, stride_xt, stride_al, stride_ar,
        BLOCK_M, BLOCK_R, BLOCK_K, UPCAST, PRECISION,
    )  # fmt: skip
    ranks = tl.arange(0, BLOCK_R)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + part * R + ranks[None, :]
    tl.store(out_ptrs, xa, mask=live[:, None] & (ranks[None, :] < R))


@triton.jit
def _lora_expand_sorted_kernel(
    y_ptr, xa_ptr, b_ptr, rows_ptr, bounds_ptr, tiles_ptr, T, N, R,
    stride_yt, stride_xat, stride_bl, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    slot, tile, col_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, live, any_row = _segment_rows(rows_ptr, bounds_ptr, slot, tile, T, BLOCK_M)
    if not any_row:
        return
    cols, end, xa_col = _expand_columns(tiles_ptr, col_tile, N, R, BLOCK_N, PARTS)
    ranks = tl.arange(0, BLOCK_R)
    xa_ptrs = xa_ptr + rows[:, None] * stride_xat + xa_col + ranks[None, :]
    xa = tl.load(xa_ptrs, mask=live[:, None] & (ranks[None, :] < R), other=0.0)
    _expand_rows(y_ptr, b_ptr, xa, rows, live, slot, cols, end, 0, R, stride_yt, stride_bl, stride_bn,
                 BLOCK_R, UPCAST, PRECISION)  # fmt: skip


# ---- wrappers ------------------------------------------------------------------------------------------


def _column_tiles(
    n: int, parts: Optional[LoraPartLayout], block_n: int, fallback: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(tile table, tile count): the layout's table for `block_n`, or `fallback` (never read) and N's tiles."""
    if parts is None:
        return fallback, cdiv(n, block_n)
    table = parts.tiles(block_n)
    return table, table.shape[0]


def lora_shrink_expand_triton(
    y: torch.Tensor,  # [T, N] model dtype (a column slice is fine), last dim contiguous; written in place
    x: torch.Tensor,  # [T, K] model dtype, last dim contiguous
    lora_a: torch.Tensor,  # [L, P*R, K] contiguous (P parts; one part: [L, R, K])
    lora_b: torch.Tensor,  # [L, N, R] contiguous (with parts: the parts' B stacked along N)
    sorted_rows: torch.Tensor,  # [>= A] int32: token rows with an adapter, grouped by slot (lora_segments)
    slot_bounds: torch.Tensor,  # [L + 1] int32: slot s's rows are sorted_rows[slot_bounds[s]:slot_bounds[s + 1]]
    parts: Optional[LoraPartLayout] = None,
    block_n: int = FUSED_BLOCK_N,
    block_m: int = FUSED_BLOCK_M,
    tiles_per_program: int = 1,
) -> None:
    """The fused shrink + expand, in place: one launch of `(L, cdiv(T, block_m), cdiv(column tiles,
    tiles_per_program))` programs (8 warps for 512-column tiles: with 4, ptxas spills the merged-projection variant
    at 255 registers). `tiles_per_program` > 1: a program computes every part's xa once and expands that many
    column tiles with it (fewer recomputed shrinks on wide groups, fewer programs at decode sizes)."""
    num_tokens, n = y.shape
    k = x.shape[1]
    num_slots, _, rank = lora_b.shape
    _check_segments(lora_b, slot_bounds)
    num_parts = 1 if parts is None else parts.num_parts
    if lora_a.shape[1] != num_parts * rank or lora_b.shape[1] != n or (parts is not None and parts.offsets[-1] != n):
        raise ValueError(
            f"fused LoRA over {num_parts} part(s): y {tuple(y.shape)}, A {tuple(lora_a.shape)} and B "
            f"{tuple(lora_b.shape)} must have {n} output columns and A {num_parts} x rank {rank} rows"
        )
    if num_tokens == 0:
        return
    tiles, col_tiles = _column_tiles(n, parts, block_n, slot_bounds)
    grid = (num_slots, cdiv(num_tokens, block_m), cdiv(col_tiles, tiles_per_program))
    _lora_fused_segment_kernel[grid](
        y, x, lora_a, lora_b, sorted_rows, slot_bounds, tiles, num_tokens, k, n, rank, lora_a.shape[1], col_tiles,
        y.stride(0), x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_b.stride(0), lora_b.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_block_r(rank), BLOCK_RA=_block_r(lora_a.shape[1]),
        BLOCK_K=FUSED_BLOCK_K, TILES=tiles_per_program, PARTS=parts is not None,
        num_warps=8 if block_n >= 512 else 4, **_dot_options(x.dtype),
    )  # fmt: skip


def lora_shrink_sorted_triton(
    x: torch.Tensor,  # [T, K] model dtype, last dim contiguous
    lora_a: torch.Tensor,  # [L, P*R, K] contiguous
    sorted_rows: torch.Tensor,  # [>= A] int32 (lora_segments)
    slot_bounds: torch.Tensor,  # [L + 1] int32
    rank: int,  # R: A's rows per part
    block_m: int = FUSED_BLOCK_M,
) -> torch.Tensor:  # [T, P*R] float32; rows without an adapter unwritten
    """The shrink over the sorted layout: one program per (slot, row tile of its segment, part)."""
    num_tokens, k = x.shape
    num_slots, rows_a, _ = lora_a.shape
    _check_segments(lora_a, slot_bounds)
    if rows_a % rank:
        raise ValueError(f"A has {rows_a} rows, not whole parts of rank {rank}")
    out = torch.empty(num_tokens, rows_a, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    _lora_shrink_sorted_kernel[(num_slots, cdiv(num_tokens, block_m), rows_a // rank)](
        x, lora_a, sorted_rows, slot_bounds, out, num_tokens, k, rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_R=_block_r(rank), BLOCK_K=FUSED_BLOCK_K, **_dot_options(x.dtype),
    )  # fmt: skip
    return out


def lora_expand_sorted_triton(
    y: torch.Tensor,  # [T, N] (a column slice is fine), last dim contiguous; written in place
    xa: torch.Tensor,  # [T, P*R] float32 from lora_shrink_sorted_triton
    lora_b: torch.Tensor,  # [L, N, R] contiguous
    sorted_rows: torch.Tensor,  # [>= A] int32
    slot_bounds: torch.Tensor,  # [L + 1] int32
    parts: Optional[LoraPartLayout] = None,
    block_n: int = SORTED_BLOCK_N,
    block_m: int = FUSED_BLOCK_M,
) -> None:
    """The expand over the sorted layout: one program per (slot, row tile of its segment, column tile)."""
    num_tokens, n = y.shape
    num_slots, _, rank = lora_b.shape
    _check_segments(lora_b, slot_bounds)
    if parts is not None:
        _check_parts(y, xa, lora_b, parts)
    if num_tokens == 0:
        return
    tiles, col_tiles = _column_tiles(n, parts, block_n, slot_bounds)
    _lora_expand_sorted_kernel[(num_slots, cdiv(num_tokens, block_m), col_tiles)](
        y, xa, lora_b, sorted_rows, slot_bounds, tiles, num_tokens, n, rank,
        y.stride(0), xa.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_block_r(rank), PARTS=parts is not None,
        **_dot_options(lora_b.dtype),
    )  # fmt: skip


# ---- dispatch ------------------------------------------------------------------------------------------


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_lora: torch.Tensor,
    sorted_rows: torch.Tensor,
    slot_bounds: torch.Tensor,
    backend: str = "auto",
    parts: Optional[LoraPartLayout] = None,
) -> None:
    """`lora_shrink_expand_triton` for CUDA tensors (or `backend="triton"`), else the reference (which reads
    `token_lora`, the same tokens' slots as the sorted layout); in place."""
    if triton_enabled(y.device, y, x, lora_a, backend=backend) and y.stride(-1) == 1 and x.stride(-1) == 1:
        lora_shrink_expand_triton(y, x, lora_a, lora_b, sorted_rows, slot_bounds, parts)
    else:
        lora_shrink_expand_reference(y, x, lora_a, lora_b, token_lora, parts)
