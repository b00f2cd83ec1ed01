"""LoRA shrink and expand: each token's low-rank update `x @ A_l^T @ B_l^T` for its own adapter `l`.

Adapters sit in `L` GPU slots, stacked per projection: `A [L, R, K]` and `B [L, N, R]` (rank padded to `R` with
zeros, the adapter's scaling folded into B). `token_lora [T]` int32 is each token's adapter slot, -1 for a token
without one: such tokens are skipped (their output is never written by expand).

- `lora_shrink`: `xa[t] = x[t] @ A[token_lora[t]]^T`, float32 `[T, R]` (rows without an adapter: 0 in the
  reference, unwritten by the kernel; expand skips them). A split shrink (K cut into `S` ranges, one program per
  range) returns the ranges' float32 partials `[S, T, R]` instead, whose sum is xa: expand adds them up as it
  loads them, in a fixed order (no extra launch, no atomics, the same result on every replay).
- `lora_expand`: `y[t] += xa[t] @ B[token_lora[t]]^T` in place, `y` may be a column slice of a wider output.
  With a `LoraPartLayout` one launch expands every part of a merged projection (q/k/v, gate/up): B is the parts'
  B matrices stacked `[L, sum N_p, R]`, xa is `[T, P*R]`, and output column c of part p reads xa columns
  `p*R .. p*R+R-1`. Column tiles come from a table built once per group, so no tile straddles two parts.

Launch shapes, chosen from the token count alone (a CUDA graph captured at one size freezes one), from the kernel
benchmark on an H100 (benchmarks/lora/bench_lora_kernels.py; docs/lora.md "Speed"):
- shrink: up to `SPLIT_K_MAX_TOKENS` tokens the segment kernel with K cut into `MAX_SPLITS` ranges, float32
  partials out (at a decode batch, a handful of row tiles each looping over all of K left most SMs idle: 2x slower
  at 8-512 tokens); above it the segment kernel over all of K, one program per (tile of tokens, adapter slot): a
  request's tokens are contiguous, so a tile is one segment of one adapter, and a program whose tile has no token
  of its adapter exits before reading any weight. The per-row kernel (one program per token row) stays selectable.
- expand: up to `ROW_EXPAND_MAX_TOKENS` tokens the per-row kernel, one program per (token row, column tile) that
  reads its own adapter only (with many adapters in a batch the segment kernel repeats each tile's dot per
  adapter); above it the segment kernel, which sums the shrink's partials as it loads them.
`lora_shrink_triton` / `lora_expand_triton` take the variant by name, so the kernel benchmark compares them.
Nothing reads the host: `token_lora` is a device tensor, so adapters may change between graph replays without
recapture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.backend import triton_enabled
from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from framework.layers.kernels.triton_norm_silu import interpreter_upcast

# Token counts of the default launches, from the kernel benchmark (H100, Qwen3-0.6B projections, rank 16, 1 and 8
# adapters): one decoder layer's LoRA takes 24-51 us at 8-256 tokens this way against 41-67 us with the per-row
# shrink and expand up to 64 tokens and segment launches above; the one case it loses is a single adapter at 256
# tokens (49 against 43 us). At 512 tokens the segment launches win (docs/lora.md "Speed").
SPLIT_K_MAX_TOKENS = 256  # shrink: split K up to here, segment over all of K above
ROW_EXPAND_MAX_TOKENS = 256  # expand: per row up to here, segment above
MAX_SPLITS = 4  # K ranges of a split shrink at most (expand reads every range's partial of each row)
MIN_SPLIT_K = 256  # K columns per range at least: below, a program's loop is too short to pay for its partial
SHRINK_VARIANTS = ("row", "segment", "split")
EXPAND_VARIANTS = ("row", "segment")
SEGMENT_BLOCK_M = 32  # token rows per program of the segment kernels
SHRINK_BLOCK_K = 64  # K columns per loop step of the segment shrink
ROW_BLOCK_N = 128  # output columns per program of the per-row expand
SEGMENT_BLOCK_N = 64  # output columns per program of the segment expand
FUSED_BLOCK_N = 256  # output columns per program of the fused shrink + expand (lora_fused.py)


def _part_tiles(offsets: Sequence[int], block_n: int, device: torch.device) -> torch.Tensor:
    """[tiles, 3] int32: (part, first column, part's end column) of each column tile; tiles restart at every part."""
    rows = [
        (part, first, offsets[part + 1])
        for part in range(len(offsets) - 1)
        for first in range(offsets[part], offsets[part + 1], block_n)
    ]
    return torch.tensor(rows, dtype=torch.int32, device=device)


class LoraPartLayout:
    """The parts of a merged projection's output for a fused expand: part p owns columns
    `offsets[p] .. offsets[p+1]-1` and reads xa columns `p*R .. p*R+R-1`. The column tile tables of both expand
    kernels are built here once, so a launch does no host work and a CUDA graph keeps their addresses."""

    def __init__(self, offsets: Sequence[int], device: torch.device) -> None:
        if len(offsets) < 2 or offsets[0] != 0 or any(b <= a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"part offsets must start at 0 and strictly increase, got {list(offsets)}")
        self.offsets = tuple(int(o) for o in offsets)  # [P + 1] column boundaries
        self.device = device
        self._tiles: dict[int, torch.Tensor] = {}
        self.row_tiles = self.tiles(ROW_BLOCK_N)  # [tiles, 3] int32
        self.segment_tiles = self.tiles(SEGMENT_BLOCK_N)  # [tiles, 3] int32
        self.tiles(FUSED_BLOCK_N)

    def tiles(self, block_n: int) -> torch.Tensor:
        """[tiles, 3] int32 table of column tiles `block_n` wide; built on the first call for a width, then kept
        (the default widths are built here: a CUDA graph never captures the host-to-device copy)."""
        table = self._tiles.get(block_n)
        if table is None:
            table = self._tiles[block_n] = _part_tiles(self.offsets, block_n, self.device)
        return table

    @property
    def num_parts(self) -> int:
        return len(self.offsets) - 1


def _check_parts(y: torch.Tensor, xa: torch.Tensor, lora_b: torch.Tensor, parts: LoraPartLayout) -> None:
    n, rank = parts.offsets[-1], lora_b.shape[2]
    if y.shape[1] != n or lora_b.shape[1] != n or xa.shape[-1] != parts.num_parts * rank:
        raise ValueError(
            f"fused expand over parts {parts.offsets}: y {tuple(y.shape)}, xa {tuple(xa.shape)} and "
            f"B {tuple(lora_b.shape)} must have {n} output columns and xa {parts.num_parts} x rank {rank} columns"
        )


# ---- references ----------------------------------------------------------------------------------------


def lora_shrink_reference(
    x: torch.Tensor,  # [T, K] model dtype
    lora_a: torch.Tensor,  # [L, R, K]
    token_lora: torch.Tensor,  # [T] int32: adapter slot of each token, -1 = none
) -> torch.Tensor:  # [T, R] float32 (0 for tokens without an adapter)
    """x @ A^T per token's adapter, accumulated in float32: one matmul against every slot's A stacked, then each
    token keeps its own slot's R columns (no host sync; one GEMM instead of one per slot keeps the CPU path fast)."""
    num_slots, rank = lora_a.shape[0], lora_a.shape[1]
    every = (x.float() @ lora_a.float().reshape(num_slots * rank, -1).t()).view(-1, num_slots, rank)  # [T, L, R]
    slot = token_lora.long().clamp(min=0).view(-1, 1, 1).expand(-1, 1, rank)
    mine = torch.gather(every, 1, slot).squeeze(1)  # [T, R]
    return torch.where((token_lora >= 0).unsqueeze(1), mine, torch.zeros_like(mine))


def lora_expand_reference(
    y: torch.Tensor,  # [T, N] written in place (a column slice of the output is fine)
    xa: torch.Tensor,  # [T, R] float32 from lora_shrink ([T, P*R] with parts), or split partials [S, T, R]
    lora_b: torch.Tensor,  # [L, N, R]
    token_lora: torch.Tensor,  # [T] int32
    parts: Optional[LoraPartLayout] = None,
) -> None:
    """y[t] += xa[t] @ B^T of its adapter (float32 sum, rounded to y's dtype); rows without one unchanged. Each
    token's R values are placed in its slot's columns of a [T, L*R] matrix, then one matmul against every slot's B.
    With `parts`, each part's columns of y, B and its R columns of xa, one after the other. Split partials are
    summed first (their rows without an adapter may hold anything: those rows are never used)."""
    if xa.dim() == 3:
        xa = xa.float().sum(0)
    if parts is not None:
        _check_parts(y, xa, lora_b, parts)
        rank = lora_b.shape[2]
        for part, (start, end) in enumerate(zip(parts.offsets, parts.offsets[1:])):
            part_xa = xa[:, part * rank : (part + 1) * rank]
            lora_expand_reference(y[:, start:end], part_xa, lora_b[:, start:end], token_lora)
        return
    num_slots, n, rank = lora_b.shape
    placed = torch.zeros(xa.shape[0], num_slots, rank, dtype=torch.float32, device=xa.device)  # [T, L, R]
    slot = token_lora.long().clamp(min=0).view(-1, 1, 1).expand(-1, 1, rank)
    placed.scatter_(1, slot, xa.float().unsqueeze(1))
    every_b = lora_b.float().permute(0, 2, 1).reshape(num_slots * rank, n)  # [L*R, N]
    acc = placed.view(xa.shape[0], num_slots * rank) @ every_b
    has = (token_lora >= 0).unsqueeze(1)
    y.copy_(torch.where(has, (y.float() + acc).to(y.dtype), y))


# ---- Triton kernels ------------------------------------------------------------------------------------


@triton.jit
def _lora_shrink_segment_kernel(
    x_ptr, a_ptr, lora_ptr, out_ptr, T, K, R, k_chunk,
    stride_xt, stride_al, stride_ar, stride_os, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # one program per (tile of rows, K range, slot); k_chunk columns per range (a multiple of BLOCK_K), or K for
    # one range (no split). Its partial goes to out[split]: every range stores, even an empty one.
    tile, split, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mine = (tl.load(lora_ptr + rows, mask=rows < T, other=-1) == slot) & (rows < T)
    if tl.max(mine.to(tl.int32), axis=0) == 0:  # no token of this adapter in the tile: read no weight
        return
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_first = split * k_chunk
    for k0 in range(k_first, tl.minimum(k_first + k_chunk, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # never past this range's end: k_chunk is whole steps, or K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :], mask=mine[:, None] & (ks[None, :] < K), other=0.0)
        a_ptrs = a_ptr + slot * stride_al + ranks[None, :] * stride_ar + ks[:, None]
        a = tl.load(a_ptrs, mask=(ranks[None, :] < R) & (ks[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_R]
        a = a.to(x.dtype)
        if UPCAST:  # interpreter only: its bfloat16 tl.dot is wrong (interpreter_upcast)
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + split * stride_os + rows[:, None] * stride_ot + ranks[None, :]
    tl.store(out_ptrs, acc, mask=mine[:, None] & (ranks[None, :] < R))


@triton.jit
def _lora_shrink_row_kernel(
    x_ptr, a_ptr, lora_ptr, out_ptr, K, R,
    stride_xt, stride_al, stride_ar, stride_ot,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(lora_ptr + row)
    if slot < 0:
        return
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xt + ks, mask=ks < K, other=0.0).to(tl.float32)
        a_ptrs = a_ptr + slot * stride_al + ranks[:, None] * stride_ar + ks[None, :]
        a = tl.load(a_ptrs, mask=(ranks[:, None] < R) & (ks[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_ot + ranks, acc, mask=ranks < R)


@triton.jit
def _expand_columns(tiles_ptr, col_tile, N, R, BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    """A column tile's output columns, its end column (exclusive) and the first xa column of its part."""
    if PARTS:  # (part, first column, part's end) from the layout's table: the tile stays inside one part
        part = tl.load(tiles_ptr + col_tile * 3)
        first = tl.load(tiles_ptr + col_tile * 3 + 1)
        end = tl.load(tiles_ptr + col_tile * 3 + 2)
        return first + tl.arange(0, BLOCK_N), end, part * R
    return col_tile * BLOCK_N + tl.arange(0, BLOCK_N), N, 0


@triton.jit
def _lora_expand_segment_kernel(
    y_ptr, xa_ptr, b_ptr, lora_ptr, tiles_ptr, T, N, R,
    stride_yt, stride_xas, stride_xat, stride_bl, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PARTS: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    tile, col_tile, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mine = (tl.load(lora_ptr + rows, mask=rows < T, other=-1) == slot) & (rows < T)
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    ranks = tl.arange(0, BLOCK_R)
    cols, end, xa_col = _expand_columns(tiles_ptr, col_tile, N, R, BLOCK_N, PARTS)
    b_ptrs = b_ptr + slot * stride_bl + cols[None, :] * stride_bn + ranks[:, None]
    b = tl.load(b_ptrs, mask=(cols[None, :] < end) & (ranks[:, None] < R), other=0.0)  # [BLOCK_R, BLOCK_N]
    xa_ptrs = xa_ptr + rows[:, None] * stride_xat + xa_col + ranks[None, :]
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in tl.static_range(SPLITS):  # a split shrink's partials, summed in order (SPLITS = 1: plain xa)
        xa += tl.load(xa_ptrs + split * stride_xas, mask=mine[:, None] & (ranks[None, :] < R), other=0.0)
    xa = xa.to(b.dtype)
    if UPCAST:
        xa, b = xa.to(tl.float32), b.to(tl.float32)
    acc = tl.dot(xa, b, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] float32
    y_ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    keep = mine[:, None] & (cols[None, :] < end)
    y = tl.load(y_ptrs, mask=keep, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=keep)


@triton.jit
def _lora_expand_row_kernel(
    y_ptr, xa_ptr, b_ptr, lora_ptr, tiles_ptr, N, R,
    stride_yt, stride_xas, stride_xat, stride_bl, stride_bn,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PARTS: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row, col_tile = tl.program_id(0), tl.program_id(1)
    slot = tl.load(lora_ptr + row)
    if slot < 0:
        return
    ranks = tl.arange(0, BLOCK_R)
    cols, end, xa_col = _expand_columns(tiles_ptr, col_tile, N, R, BLOCK_N, PARTS)
    xa = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):  # a split shrink's partials, summed in order (SPLITS = 1: plain xa)
        xa += tl.load(xa_ptr + split * stride_xas + row * stride_xat + xa_col + ranks, mask=ranks < R, other=0.0)
    b_ptrs = b_ptr + slot * stride_bl + cols[:, None] * stride_bn + ranks[None, :]
    b = tl.load(b_ptrs, mask=(cols[:, None] < end) & (ranks[None, :] < R), other=0.0).to(tl.float32)
    acc = tl.sum(b * xa[None, :], axis=1)
    y_ptrs = y_ptr + row * stride_yt + cols
    y = tl.load(y_ptrs, mask=cols < end, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=cols < end)


def _dot_options(dtype: torch.dtype) -> dict:
    """UPCAST (interpreter, bfloat16) and PRECISION ("ieee": float32 inputs are not rounded to TF32)."""
    return {"UPCAST": interpreter_upcast(dtype), "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _block_r(rank: int) -> int:
    return max(16, next_power_of_2(rank))


def shrink_plan(num_tokens: int, k: int) -> tuple[str, int]:
    """The default shrink variant and its K ranges for a step of `num_tokens` tokens over `k` input columns: split K
    up to `SPLIT_K_MAX_TOKENS` (K / `MIN_SPLIT_K` ranges, at most `MAX_SPLITS`), else segment (a function of the
    shapes alone, so a CUDA graph captured at one size keeps one launch)."""
    if num_tokens <= SPLIT_K_MAX_TOKENS:
        return "split", max(1, min(MAX_SPLITS, k // MIN_SPLIT_K))
    return "segment", 1


def lora_shrink_triton(
    x: torch.Tensor,  # [T, K] model dtype, last dim contiguous
    lora_a: torch.Tensor,  # [L, R, K] contiguous
    token_lora: torch.Tensor,  # [T] int32 (token -> adapter slot, -1 none)
    variant: Optional[str] = None,
    splits: Optional[int] = None,
    block_m: int = SEGMENT_BLOCK_M,
) -> torch.Tensor:  # [T, R] float32, or [S, T, R] partials (split); rows without an adapter unwritten
    """The Triton shrink. `variant`: "row" (one program per token row), "segment" (per tile of `block_m` rows and
    adapter slot) or "split" (segment with K cut into `splits` ranges, partials out: S <= splits, fewer when
    ranges of whole `SHRINK_BLOCK_K` steps cover K sooner); None: `shrink_plan`."""
    num_tokens, k = x.shape
    num_slots, rank, _ = lora_a.shape
    if variant is None:
        variant, splits = shrink_plan(num_tokens, k)
    if variant not in SHRINK_VARIANTS:
        raise ValueError(f"unknown LoRA shrink variant {variant!r}; expected one of {SHRINK_VARIANTS}")
    steps = cdiv(k, SHRINK_BLOCK_K)
    chunk = k if variant != "split" else cdiv(steps, max(1, min(splits or MAX_SPLITS, steps))) * SHRINK_BLOCK_K
    num_splits = cdiv(k, chunk)  # no empty range
    shape = (num_splits, num_tokens, rank) if variant == "split" else (num_tokens, rank)
    out = torch.empty(shape, dtype=torch.float32, device=x.device)  # no memset launch per group
    if num_tokens == 0:
        return out
    stride_os, stride_ot = (out.stride(0), out.stride(1)) if variant == "split" else (0, out.stride(0))
    if variant == "row":
        args = (x.stride(0), lora_a.stride(0), lora_a.stride(1), stride_ot)
        _lora_shrink_row_kernel[(num_tokens,)](
            x, lora_a, token_lora, out, k, rank, *args, BLOCK_R=_block_r(rank), BLOCK_K=128
        )
    else:
        grid = (cdiv(num_tokens, block_m), num_splits, num_slots)
        _lora_shrink_segment_kernel[grid](
            x, lora_a, token_lora, out, num_tokens, k, rank, chunk,
            x.stride(0), lora_a.stride(0), lora_a.stride(1), stride_os, stride_ot,
            BLOCK_M=block_m, BLOCK_R=_block_r(rank), BLOCK_K=SHRINK_BLOCK_K, **_dot_options(x.dtype),
        )  # fmt: skip
    return out


def lora_expand_triton(
    y: torch.Tensor,  # [T, N] (a column slice is fine), last dim contiguous
    xa: torch.Tensor,  # [T, R] float32, last dim contiguous ([T, P*R] with parts), or split partials [S, T, R]
    lora_b: torch.Tensor,  # [L, N, R] contiguous (with parts: the parts' B stacked along N)
    token_lora: torch.Tensor,  # [T] int32
    parts: Optional[LoraPartLayout] = None,
    variant: Optional[str] = None,
) -> None:
    """The Triton expand, in place. `variant`: "row" (one program per (token row, column tile)) or "segment" (per
    tile of rows, column tile and slot); None: row up to `ROW_EXPAND_MAX_TOKENS` tokens, segment above. With `parts`,
    one launch for every part (column tiles from the layout's tables, so the grid is fixed per group)."""
    num_tokens, n = y.shape
    num_slots, _, rank = lora_b.shape
    if parts is not None:
        _check_parts(y, xa, lora_b, parts)
    if variant is None:
        variant = "row" if num_tokens <= ROW_EXPAND_MAX_TOKENS else "segment"
    if variant not in EXPAND_VARIANTS:
        raise ValueError(f"unknown LoRA expand variant {variant!r}; expected one of {EXPAND_VARIANTS}")
    if num_tokens == 0:
        return
    splits, stride_xas = (xa.shape[0], xa.stride(0)) if xa.dim() == 3 else (1, 0)
    args = (y.stride(0), stride_xas, xa.stride(-2), lora_b.stride(0), lora_b.stride(1))
    per_row = variant == "row"
    if parts is None:  # one part: tiles from the column count; the table pointer is never read
        tiles, col_tiles = token_lora, cdiv(n, ROW_BLOCK_N if per_row else SEGMENT_BLOCK_N)
    else:
        tiles = parts.row_tiles if per_row else parts.segment_tiles
        col_tiles = tiles.shape[0]
    fused = parts is not None
    if per_row:
        _lora_expand_row_kernel[(num_tokens, col_tiles)](
            y, xa, lora_b, token_lora, tiles, n, rank, *args,
            BLOCK_N=ROW_BLOCK_N, BLOCK_R=_block_r(rank), PARTS=fused, SPLITS=splits,
        )  # fmt: skip
    else:
        _lora_expand_segment_kernel[(cdiv(num_tokens, SEGMENT_BLOCK_M), col_tiles, num_slots)](
            y, xa, lora_b, token_lora, tiles, num_tokens, n, rank, *args,
            BLOCK_M=SEGMENT_BLOCK_M, BLOCK_N=SEGMENT_BLOCK_N, BLOCK_R=_block_r(rank), PARTS=fused, SPLITS=splits,
            **_dot_options(lora_b.dtype),
        )  # fmt: skip


# ---- dispatch ------------------------------------------------------------------------------------------


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_lora: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:  # [T, R] float32, or [S, T, R] split partials: pass it to lora_expand as it is
    """`lora_shrink_triton` for CUDA tensors (or `backend="triton"`), else `lora_shrink_reference`."""
    if triton_enabled(x.device, x, lora_a, backend=backend) and x.stride(-1) == 1:
        return lora_shrink_triton(x, lora_a, token_lora)
    return lora_shrink_reference(x, lora_a, token_lora)


def lora_expand(
    y: torch.Tensor,
    xa: torch.Tensor,
    lora_b: torch.Tensor,
    token_lora: torch.Tensor,
    backend: str = "auto",
    parts: Optional[LoraPartLayout] = None,
) -> None:
    """`lora_expand_triton` for CUDA tensors (or `backend="triton"`), else `lora_expand_reference`; in place.
    `parts`: one expand over every part of a merged projection (see `LoraPartLayout`)."""
    if triton_enabled(y.device, y, lora_b, backend=backend) and y.stride(-1) == 1:
        lora_expand_triton(y, xa, lora_b, token_lora, parts)
    else:
        lora_expand_reference(y, xa, lora_b, token_lora, parts)
