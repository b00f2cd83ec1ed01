"""The chunked (WY / UT-transform) form of the gated delta rule in Triton: the prefill kernel of Gated DeltaNet.

Same arguments and results as `gated_delta_rule_varlen_triton` (`framework.layers.kernels.gated_delta_rule`):
a varlen batch, each row continuing from its slot's `[H, Dk, Dv]` float32 state (`idx_mapping`) and leaving it
advanced, optional tails (the state after each of a row's last `num_tail` tokens) and snapshots (the state after
given token counts, into a pool). The recurrent kernel steps token by token; this one takes up to `BT` (64)
tokens at a time, as matrix products.

For a chunk of `n` tokens starting from state `h` (q, k L2-normed in the kernel, q scaled by `Dk ** -0.5`),
with `c` the cumulative log decay inside the chunk (gating stays in log space: every decay factor is
`exp(c_i - c_j)` with `j <= i`, never a ratio of exponentials):

    A[i, j] = beta_i exp(c_i - c_j) (k_i . k_j)  for j < i       (strictly lower triangular)
    T       = (I + A)^-1                                           (the UT transform)
    u       = T (beta * (v - exp(c) * (K h)))                      (the corrected values)
    o       = exp(c) * (Q h) + (exp(c_i - c_j) [j <= i] * Q K^T) u
    h'      = exp(c_n) h + (exp(c_n - c) * K)^T u

`T` is built by block doubling: with `X` the inverse of `I + A` restricted to diagonal blocks of size `s`
(`X = I` for `s = 1`) and `O` the part of `A` inside blocks of size `2s` but outside those of size `s`,
`X - X O X` is the inverse on blocks of size `2s` (the 2x2 block-triangular inverse, all blocks at once);
log2(BT) steps of two products.

One program per (row, value head, block of Dv) walks its row chunk by chunk, so the grid and the in-kernel
metadata are the recurrent kernel's (no host synchronisation; safe inside a CUDA graph). A chunk ends early where
a state must be stored: at a snapshot's token count and at each of the tail tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from framework.layers.kernels.state_snapshots import SnapshotTargets

CHUNK = 64  # tokens per chunk (power of two, >= 16 for the tensor-core products)


@triton.jit
def _ut_inverse(a, ts, BT: tl.constexpr, LOG_BT: tl.constexpr, PREC: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular [BT, BT] tile, by block doubling."""
    x = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0)
    for e in tl.static_range(LOG_BT):
        inner = (ts[:, None] >> (e + 1)) == (ts[None, :] >> (e + 1))  # same block of 2^(e+1)
        outer = (ts[:, None] >> e) != (ts[None, :] >> e)  # different blocks of 2^e
        o = tl.where(inner & outer, a, 0.0)
        xo = tl.dot(x, o, input_precision=PREC)
        x = x - tl.dot(xo, x, input_precision=PREC)
    return x


@triton.jit
def _next_cut(pos, q_len, snap_at, num_tail, BT: tl.constexpr, STORE_TAIL: tl.constexpr, SNAP: tl.constexpr):
    """Tokens in the chunk starting at `pos`: up to BT, ending at the next snapshot or tail token."""
    n = tl.minimum(q_len - pos, BT)
    if SNAP:
        if snap_at > pos:
            n = tl.minimum(n, snap_at - pos)
    if STORE_TAIL:
        first = q_len - num_tail + 1  # token count of the first tail state
        if pos + 1 >= first:
            n = tl.minimum(n, 1)
        else:
            n = tl.minimum(n, first - pos)
    return n


@triton.jit
def _chunk_gated_delta_rule_kernel(
    q_ptr,
    k_ptr,  # [T, Hk, Dk] contiguous, model dtype
    v_ptr,
    out_ptr,  # [T, H, Dv] contiguous
    g_ptr,
    beta_ptr,  # [T, H] float32
    state_ptr,
    state_stride,  # [S, H, Dk, Dv] float32
    idx_mapping_ptr,
    qsl_ptr,
    tail_ptr,
    tail_row_stride,
    num_tail,  # [R, num_tail, H, Dk, Dv] float32
    snap_start_ptr,
    snap_tokens_ptr,
    snap_slot_ptr,  # SnapshotTargets: [R+1], [M], [M] int32
    pool_ptr,
    pool_stride,  # [P, H, Dk, Dv] float32
    num_heads,
    num_k_heads,
    dk,
    dv,
    scale,
    STORE_TAIL: tl.constexpr,
    STORE_SNAPSHOTS: tl.constexpr,
    BT: tl.constexpr,
    LOG_BT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PREC: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    ts = tl.arange(0, BT)
    kmask, vmask = ks < dk, vs < dv
    mask2 = kmask[:, None] & vmask[None, :]
    k_head = head // (num_heads // num_k_heads)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    start = tl.load(qsl_ptr + row).to(tl.int64)
    q_len = tl.load(qsl_ptr + row + 1) - tl.load(qsl_ptr + row)
    head_tile = dk * dv
    tile = head * head_tile + ks[:, None] * dv + vs[None, :]
    h = tl.load(state_ptr + slot * state_stride + tile, mask=mask2, other=0.0)
    snap = tl.load(snap_start_ptr + row) if STORE_SNAPSHOTS else 0
    snap_end = tl.load(snap_start_ptr + row + 1) if STORE_SNAPSHOTS else 0
    snap_at = tl.load(snap_tokens_ptr + snap, mask=snap < snap_end, other=-1) if STORE_SNAPSHOTS else -1
    if STORE_SNAPSHOTS:
        if snap_at == 0:  # the state before the step
            tl.store(pool_ptr + tl.load(snap_slot_ptr + snap).to(tl.int64) * pool_stride + tile, h, mask=mask2)
            snap += 1
            snap_at = tl.load(snap_tokens_ptr + snap, mask=snap < snap_end, other=-1)
    lower = ts[:, None] > ts[None, :]
    causal = ts[:, None] >= ts[None, :]
    pos = q_len * 0
    while pos < q_len:
        n = _next_cut(pos, q_len, snap_at, num_tail, BT, STORE_TAIL, STORE_SNAPSHOTS)
        tok = start + pos + ts  # [BT] int64
        tmask = ts < n
        qk_off = (tok * num_k_heads + k_head) * dk
        kt_mask = tmask[:, None] & kmask[None, :]
        k = tl.load(k_ptr + qk_off[:, None] + ks[None, :], mask=kt_mask, other=0.0).to(tl.float32)
        k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        vt_off = (tok * num_heads + head) * dv
        vt_mask = tmask[:, None] & vmask[None, :]
        v = tl.load(v_ptr + vt_off[:, None] + vs[None, :], mask=vt_mask, other=0.0).to(tl.float32)
        gl = tl.load(g_ptr + tok * num_heads + head, mask=tmask, other=0.0)
        beta = tl.load(beta_ptr + tok * num_heads + head, mask=tmask, other=0.0)
        c = tl.cumsum(gl, axis=0)  # [BT]; constant past the chunk's end (g = 0 there)
        c_last = tl.sum(gl, axis=0)
        decay = tl.exp(tl.where(causal, c[:, None] - c[None, :], float("-inf")))  # [BT, BT]
        kk = tl.dot(k, tl.trans(k), input_precision=PREC)
        t_inv = _ut_inverse(tl.where(lower, beta[:, None] * decay * kk, 0.0), ts, BT, LOG_BT, PREC)
        ec = tl.exp(c)
        rhs = beta[:, None] * (v - ec[:, None] * tl.dot(k, h, input_precision=PREC))
        u = tl.dot(t_inv, rhs, input_precision=PREC)  # [BT, BLOCK_V]
        q = tl.load(q_ptr + qk_off[:, None] + ks[None, :], mask=kt_mask, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * scale
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
        o = ec[:, None] * tl.dot(q, h, input_precision=PREC) + tl.dot(qk, u, input_precision=PREC)
        tl.store(out_ptr + vt_off[:, None] + vs[None, :], o.to(out_ptr.dtype.element_ty), mask=vt_mask)
        kd = k * tl.exp(c_last - c)[:, None]
        h = tl.exp(c_last) * h + tl.dot(tl.trans(kd), u, input_precision=PREC)
        pos += n
        if STORE_TAIL:
            j = pos - q_len + num_tail - 1
            if j >= 0:
                tl.store(tail_ptr + row * tail_row_stride + j * num_heads * head_tile + tile, h, mask=mask2)
        if STORE_SNAPSHOTS:
            if pos == snap_at:
                tl.store(pool_ptr + tl.load(snap_slot_ptr + snap).to(tl.int64) * pool_stride + tile, h, mask=mask2)
                snap += 1
                snap_at = tl.load(snap_tokens_ptr + snap, mask=snap < snap_end, other=-1)
    tl.store(state_ptr + slot * state_stride + tile, h, mask=mask2)


def check_state_arguments(
    state: torch.Tensor,  # [S, H, Dk, Dv] float32
    num_heads: int,
    num_k_heads: int,
    dk: int,
    dv: int,
    snapshots: Optional[SnapshotTargets],
    snapshot_pool: Optional[torch.Tensor],
) -> None:
    """The checks both delta-rule kernels' wrappers make before a launch; a `ValueError` names what is wrong."""
    if state.dtype != torch.float32 or state.shape[1:] != (num_heads, dk, dv):
        raise ValueError(f"state must be float32 [S, {num_heads}, {dk}, {dv}], got {state.dtype} {list(state.shape)}")
    if num_heads % num_k_heads:
        raise ValueError(f"{num_heads} value heads are not a multiple of {num_k_heads} key heads")
    if snapshots is not None and snapshot_pool is None:
        raise ValueError("snapshots need a snapshot_pool to store into")


def chunk_gated_delta_rule_varlen_triton(
    q: torch.Tensor,  # [T, Hk, Dk] model dtype, not yet L2-normed
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H] log decay (<= 0)
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [S, H, Dk, Dv] float32, contiguous per slot
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    query_start_loc: torch.Tensor,  # [R+1] int32
    tail_states: Optional[torch.Tensor] = None,  # [R, num_tail, H, Dk, Dv] float32
    snapshots: Optional[SnapshotTargets] = None,
    snapshot_pool: Optional[torch.Tensor] = None,  # [P, H, Dk, Dv] float32
    block_v: int = 128,
    num_warps: int = 8,
) -> torch.Tensor:
    """[T, H, Dv]: the chunked form in one launch (grid: rows x value heads x Dv blocks of `block_v`).

    Tiles: the whole 128-wide value head per program, 8 warps, the fastest of six (Dv block, warps) pairs at every
    shape of `benchmarks/gdn/bench_gdn_prefill.py` on an H100 (1.2-2.9x the 32-wide, 8-warp tiles; docs/benchmarks.md).
    """
    num_k_heads, dk = k.shape[1:]
    num_heads, dv = v.shape[1:]
    check_state_arguments(state, num_heads, num_k_heads, dk, dv, snapshots, snapshot_pool)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty_like(v)
    rows = idx_mapping.numel()
    if rows == 0:
        return out
    block_k = max(16, next_power_of_2(dk))
    block_v = max(16, min(next_power_of_2(dv), block_v))
    snap = snapshots if snapshots is not None else (idx_mapping, idx_mapping, idx_mapping)
    _chunk_gated_delta_rule_kernel[(rows, num_heads, cdiv(dv, block_v))](
        q,
        k,
        v,
        out,
        g,
        beta,
        state,
        state.stride(0),
        idx_mapping,
        query_start_loc,
        tail_states if tail_states is not None else state,
        tail_states.stride(0) if tail_states is not None else 0,
        tail_states.shape[1] if tail_states is not None else 0,
        snap[0],
        snap[1],
        snap[2],
        snapshot_pool if snapshot_pool is not None else state,
        snapshot_pool.stride(0) if snapshot_pool is not None else 0,
        num_heads,
        num_k_heads,
        dk,
        dv,
        dk**-0.5,
        STORE_TAIL=tail_states is not None,
        STORE_SNAPSHOTS=snapshots is not None,
        BT=CHUNK,
        LOG_BT=CHUNK.bit_length() - 1,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        PREC="tf32x3" if v.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    return out
