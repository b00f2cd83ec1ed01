"""Mamba-1 selective scan over a varlen batch, starting from and advancing each request slot's SSM state.

Per channel d, state index n and token t of a row (all arithmetic in float32):

    dt      = softplus(dt_raw[t, d] + dt_bias[d])
    h[d, n] = exp(A[d, n] * dt) * h[d, n] + dt * B[t, n] * x[t, d]
    y[t, d] = (sum_n h[d, n] * C[t, n] + D[d] * x[t, d]) * silu(z[t, d])

`h` starts from the row's slot state, so a prefill chunk continues where the previous chunk of the same
request stopped, and ends there for the next step. Two kernels share the per-token update: the varlen scan
(prefill chunks, mixed batches, draft verification: each (row, channel block) program walks its tokens in
order) and the one-step state update of a pure decode batch. With `tail_states` the scan also writes the
state after each of a row's last `num_tail` tokens, from which speculative decoding keeps the accepted one.
With `snapshots` the scan stores the state after the requested numbers of a row's tokens into slots of a
snapshot pool (prefix caching: the state at block boundaries, `framework.layers.kernels.state_snapshots`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from framework.layers.kernels.state_snapshots import SnapshotTargets, snapshots_by_row


class ScanWeights(NamedTuple):
    """The per-channel parameters of one Mamba layer."""

    A: torch.Tensor  # [D, N] float32 (negative: -exp(A_log))
    D: torch.Tensor  # [D]
    dt_bias: torch.Tensor  # [D]


class ScanInputs(NamedTuple):
    """This step's per-token inputs of one Mamba layer, rows flattened."""

    x: torch.Tensor  # [T, D] conv output
    dt: torch.Tensor  # [T, D] before bias and softplus
    B: torch.Tensor  # [T, N]
    C: torch.Tensor  # [T, N]
    z: torch.Tensor  # [T, D] gate


def _softplus(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v > 20.0, v, torch.log1p(torch.exp(v)))  # torch's softplus, threshold 20


def selective_scan_varlen_reference(
    inp: ScanInputs,
    w: ScanWeights,
    ssm_state: torch.Tensor,  # [S, D, N] float32 by req_slot, updated in place
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    query_start_loc: torch.Tensor,  # [R+1] int32: first token of each row
    tail_states: Optional[torch.Tensor] = None,  # [R, num_tail, D, N] float32
    snapshots: Optional[SnapshotTargets] = None,  # per row: states to store into `snapshot_pool`
    snapshot_pool: Optional[torch.Tensor] = None,  # [P, D, N] float32 by snapshot slot
) -> torch.Tensor:
    """[T, D] in x's dtype: the gated scan output; each row's slot state advances by its tokens."""
    A, Dp = w.A.float(), w.D.float()
    out = torch.empty_like(inp.x)
    starts = query_start_loc.tolist()
    by_row = snapshots_by_row(snapshots, snapshot_pool, idx_mapping.numel())
    for row, slot in enumerate(idx_mapping.tolist()):
        lo, hi = starts[row], starts[row + 1]
        h = ssm_state[slot].float()
        wanted = dict(by_row[row])  # tokens consumed -> pool slot
        if 0 in wanted:
            snapshot_pool[wanted[0]] = h  # type: ignore[index]
        for t in range(lo, hi):
            x = inp.x[t].float()
            dt = _softplus(inp.dt[t].float() + w.dt_bias.float())
            h = torch.exp(A * dt[:, None]) * h + (dt * x)[:, None] * inp.B[t].float()[None, :]
            y = h @ inp.C[t].float() + Dp * x
            out[t] = (y * torch.nn.functional.silu(inp.z[t].float())).to(out.dtype)
            if tail_states is not None:
                j = t - hi + tail_states.shape[1]  # tail index of the state after token t
                if j >= 0:
                    tail_states[row, j] = h
            if t - lo + 1 in wanted:
                snapshot_pool[wanted[t - lo + 1]] = h  # type: ignore[index]
        ssm_state[slot] = h.to(ssm_state.dtype)
    return out


def selective_state_update_reference(
    inp: ScanInputs,  # one token per row: T = R
    w: ScanWeights,
    ssm_state: torch.Tensor,  # [S, D, N] float32, updated in place
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
) -> torch.Tensor:
    """[R, D]: one decode step per row (the varlen scan with every row one token long), batched."""
    slots = idx_mapping.long()
    x, z = inp.x.float(), inp.z.float()
    dt = _softplus(inp.dt.float() + w.dt_bias.float())  # [R, D]
    h = ssm_state[slots].float()
    h = torch.exp(w.A.float()[None] * dt[..., None]) * h + (dt * x)[..., None] * inp.B.float()[:, None, :]
    ssm_state[slots] = h.to(ssm_state.dtype)
    y = (h @ inp.C.float()[..., None])[..., 0] + w.D.float() * x
    return (y * torch.nn.functional.silu(z)).to(inp.x.dtype)


# ---- Triton kernels ------------------------------------------------------------------------------------


@triton.jit
def _ssm_token(
    h,
    tok,
    ch,
    cmask,
    ns,
    nmask,
    A,
    Dp,
    dt_bias,
    x_ptr,
    dt_ptr,
    z_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    tok_stride_d,
    tok_stride_n,
):
    """One token's update of the [BLOCK_D, BLOCK_N] state tile; stores y, returns the new state."""
    x = tl.load(x_ptr + tok * tok_stride_d + ch, mask=cmask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + tok * tok_stride_d + ch, mask=cmask, other=0.0).to(tl.float32) + dt_bias
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
    z = tl.load(z_ptr + tok * tok_stride_d + ch, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + tok * tok_stride_n + ns, mask=nmask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + tok * tok_stride_n + ns, mask=nmask, other=0.0).to(tl.float32)
    h = tl.exp(A * dt[:, None]) * h + (dt * x)[:, None] * b[None, :]
    y = tl.sum(h * c[None, :], axis=1) + Dp * x
    y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + tok * tok_stride_d + ch, y.to(out_ptr.dtype.element_ty), mask=cmask)
    return h


@triton.jit
def _selective_scan_varlen_kernel(
    x_ptr,
    dt_ptr,
    z_ptr,
    b_ptr,
    c_ptr,
    out_ptr,  # [T, D] x3, [T, N] x2, [T, D]; all contiguous
    a_ptr,
    d_ptr,
    dt_bias_ptr,  # [D, N], [D], [D]
    state_ptr,
    state_stride,  # [S, D, N] float32
    idx_mapping_ptr,
    qsl_ptr,
    tail_ptr,
    tail_row_stride,
    num_tail,  # [R, num_tail, D, N] float32
    snap_start_ptr,
    snap_tokens_ptr,
    snap_slot_ptr,  # SnapshotTargets: [R+1], [M], [M] int32
    pool_ptr,
    pool_stride,  # [P, D, N] float32 snapshot pool
    dim,
    nstate,
    STORE_TAIL: tl.constexpr,
    STORE_SNAPSHOTS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ns = tl.arange(0, BLOCK_N)
    cmask, nmask = ch < dim, ns < nstate
    mask2 = cmask[:, None] & nmask[None, :]
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    start = tl.load(qsl_ptr + row).to(tl.int64)  # token offsets in int64: T * D may pass 2**31
    end = tl.load(qsl_ptr + row + 1).to(tl.int64)
    tile = ch[:, None] * nstate + ns[None, :]
    A = tl.load(a_ptr + tile, mask=mask2, other=0.0).to(tl.float32)
    Dp = tl.load(d_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    h = tl.load(state_ptr + slot * state_stride + tile, mask=mask2, other=0.0)
    # Snapshots: walk the row's entries in order; `snap_at` = tokens consumed at the next one (-1: none left).
    snap = tl.load(snap_start_ptr + row) if STORE_SNAPSHOTS else 0
    snap_end = tl.load(snap_start_ptr + row + 1) if STORE_SNAPSHOTS else 0
    snap_at = tl.load(snap_tokens_ptr + snap, mask=snap < snap_end, other=-1) if STORE_SNAPSHOTS else -1
    if STORE_SNAPSHOTS:
        if snap_at == 0:  # the state before the step
            tl.store(pool_ptr + tl.load(snap_slot_ptr + snap).to(tl.int64) * pool_stride + tile, h, mask=mask2)
            snap += 1
            snap_at = tl.load(snap_tokens_ptr + snap, mask=snap < snap_end, other=-1)
    for tok in range(start, end):
        h = _ssm_token(
            h, tok, ch, cmask, ns, nmask, A, Dp, dt_bias, x_ptr, dt_ptr, z_ptr, b_ptr, c_ptr, out_ptr, dim, nstate
        )
        if STORE_TAIL:
            j = tok - end + num_tail
            if j >= 0:
                tl.store(tail_ptr + row * tail_row_stride + j * dim * nstate + tile, h, mask=mask2)
        if STORE_SNAPSHOTS:
            if tok - start + 1 == snap_at:
                tl.store(pool_ptr + tl.load(snap_slot_ptr + snap).to(tl.int64) * pool_stride + tile, h, mask=mask2)
                snap += 1
                snap_at = tl.load(snap_tokens_ptr + snap, mask=snap < snap_end, other=-1)
    tl.store(state_ptr + slot * state_stride + tile, h, mask=mask2)


@triton.jit
def _selective_state_update_kernel(
    x_ptr,
    dt_ptr,
    z_ptr,
    b_ptr,
    c_ptr,
    out_ptr,  # [R, D] x3, [R, N] x2, [R, D]
    a_ptr,
    d_ptr,
    dt_bias_ptr,
    state_ptr,
    state_stride,
    idx_mapping_ptr,
    dim,
    nstate,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ns = tl.arange(0, BLOCK_N)
    cmask, nmask = ch < dim, ns < nstate
    mask2 = cmask[:, None] & nmask[None, :]
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    tile = ch[:, None] * nstate + ns[None, :]
    A = tl.load(a_ptr + tile, mask=mask2, other=0.0).to(tl.float32)
    Dp = tl.load(d_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    h = tl.load(state_ptr + slot * state_stride + tile, mask=mask2, other=0.0)
    h = _ssm_token(
        h,
        row.to(tl.int64),
        ch,
        cmask,
        ns,
        nmask,
        A,
        Dp,
        dt_bias,
        x_ptr,
        dt_ptr,
        z_ptr,
        b_ptr,
        c_ptr,
        out_ptr,
        dim,
        nstate,
    )
    tl.store(state_ptr + slot * state_stride + tile, h, mask=mask2)


def _check(inp: ScanInputs, w: ScanWeights, ssm_state: torch.Tensor) -> tuple[ScanInputs, ScanWeights]:
    dim, nstate = w.A.shape
    if ssm_state.dtype != torch.float32 or ssm_state.shape[1:] != (dim, nstate) or not ssm_state.is_contiguous():
        raise ValueError(
            f"ssm_state must be contiguous float32 [S, {dim}, {nstate}], got {ssm_state.dtype} {tuple(ssm_state.shape)}"
        )
    return ScanInputs(*(t.contiguous() for t in inp)), ScanWeights(*(t.contiguous() for t in w))


def _blocks(dim: int, nstate: int, rows: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N): a state tile of at most 2048 floats in registers; narrower channel blocks when few
    rows would leave most of the GPU idle (each program walks its row's tokens one after another)."""
    block_n = next_power_of_2(nstate)
    block_d = min(next_power_of_2(dim), max(16, 2048 // block_n))
    while block_d > 16 and rows * cdiv(dim, block_d) < 256:
        block_d //= 2
    return block_d, block_n


def selective_scan_varlen_triton(
    inp: ScanInputs,
    w: ScanWeights,
    ssm_state: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    tail_states: Optional[torch.Tensor] = None,
    snapshots: Optional[SnapshotTargets] = None,
    snapshot_pool: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton version of `selective_scan_varlen_reference`: one program per (batch row, channel block)."""
    inp, w = _check(inp, w, ssm_state)
    if snapshots is not None:
        if snapshot_pool is None:
            raise ValueError("snapshots need a snapshot_pool to store into")
        _check(inp, w, snapshot_pool)
    dim, nstate = w.A.shape
    out = torch.empty_like(inp.x)
    rows = idx_mapping.numel()
    if rows == 0:
        return out
    block_d, block_n = _blocks(dim, nstate, rows)
    tail = tail_states if tail_states is not None else ssm_state
    _selective_scan_varlen_kernel[(rows, cdiv(dim, block_d))](
        inp.x,
        inp.dt,
        inp.z,
        inp.B,
        inp.C,
        out,
        w.A,
        w.D,
        w.dt_bias,
        ssm_state,
        ssm_state.stride(0),
        idx_mapping,
        query_start_loc,
        tail,
        tail.stride(0) if tail_states is not None else 0,
        tail_states.shape[1] if tail_states is not None else 0,
        *(snapshots if snapshots is not None else (idx_mapping,) * 3),
        snapshot_pool if snapshot_pool is not None else ssm_state,
        snapshot_pool.stride(0) if snapshot_pool is not None else 0,
        dim,
        nstate,
        STORE_TAIL=tail_states is not None,
        STORE_SNAPSHOTS=snapshots is not None,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
    )
    return out


def selective_state_update_triton(
    inp: ScanInputs,
    w: ScanWeights,
    ssm_state: torch.Tensor,
    idx_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton version of `selective_state_update_reference` (one token per row)."""
    inp, w = _check(inp, w, ssm_state)
    dim, nstate = w.A.shape
    out = torch.empty_like(inp.x)
    rows = idx_mapping.numel()
    if rows == 0:
        return out
    block_d, block_n = _blocks(dim, nstate, rows)
    _selective_state_update_kernel[(rows, cdiv(dim, block_d))](
        inp.x,
        inp.dt,
        inp.z,
        inp.B,
        inp.C,
        out,
        w.A,
        w.D,
        w.dt_bias,
        ssm_state,
        ssm_state.stride(0),
        idx_mapping,
        dim,
        nstate,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
    )
    return out


def selective_scan_varlen(
    inp: ScanInputs,
    w: ScanWeights,
    ssm_state: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    tail_states: Optional[torch.Tensor] = None,
    snapshots: Optional[SnapshotTargets] = None,
    snapshot_pool: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dispatch: Triton for CUDA tensors, the reference elsewhere."""
    fn = selective_scan_varlen_triton if inp.x.is_cuda else selective_scan_varlen_reference
    return fn(inp, w, ssm_state, idx_mapping, query_start_loc, tail_states, snapshots, snapshot_pool)


def selective_state_update(
    inp: ScanInputs, w: ScanWeights, ssm_state: torch.Tensor, idx_mapping: torch.Tensor
) -> torch.Tensor:
    """Dispatch: Triton for CUDA tensors, the reference elsewhere."""
    fn = selective_state_update_triton if inp.x.is_cuda else selective_state_update_reference
    return fn(inp, w, ssm_state, idx_mapping)
