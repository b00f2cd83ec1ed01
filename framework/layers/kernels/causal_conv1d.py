"""Depthwise causal conv1d over a varlen batch, continuing from and advancing each request slot's conv state.

One kernel serves prefill chunks and decode steps alike: a row's input is its slot's last `K-1` inputs
(`conv_state`) followed by its `q` new tokens, so a chunked prefill or a resumed request continues exactly
where it stopped, and a decode step is the `q = 1` case. After the step the slot's conv state holds the
last `K-1` inputs of the concatenation.

Speculative decoding needs the state as it was after fewer tokens than were run: with `tail_states` the
kernels also write, for each row, the conv state after each of its last `num_tail` tokens, so
`MambaHybridModelState.postprocess` can keep the one that matches the accepted tokens.

Prefix caching needs the state at block boundaries inside a chunk: with `snapshots` (and a `snapshot_pool`)
the kernels also store, for each requested (row, tokens consumed), the conv state at that point into a slot of
the snapshot pool (`framework.layers.kernels.state_snapshots`).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from framework.layers.kernels.state_snapshots import SnapshotTargets, snapshots_by_row


def causal_conv1d_varlen_reference(
    x: torch.Tensor,  # [T, D] model dtype: this step's inputs, rows flattened
    weight: torch.Tensor,  # [D, K]
    bias: Optional[torch.Tensor],  # [D]
    conv_state: torch.Tensor,  # [S, D, K-1] by req_slot, updated in place
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    query_start_loc: torch.Tensor,  # [R+1] int32: first token of each row
    tail_states: Optional[torch.Tensor] = None,  # [R, num_tail, D, K-1]: state after each of the last tokens
    snapshots: Optional[SnapshotTargets] = None,  # per row: states to store into `snapshot_pool`
    snapshot_pool: Optional[torch.Tensor] = None,  # [P, D, K-1] by snapshot slot
) -> torch.Tensor:
    """[T, D] silu(conv(x) + bias), each row continuing from its slot's conv state (which advances)."""
    k = weight.shape[1]
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    by_row = snapshots_by_row(snapshots, snapshot_pool, idx_mapping.numel())
    for row, slot in enumerate(idx_mapping.tolist()):
        lo, hi = starts[row], starts[row + 1]
        full = torch.cat([conv_state[slot].to(x.dtype), x[lo:hi].t()], dim=1)  # [D, K-1+q]
        y = torch.nn.functional.conv1d(
            full.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0]
        )[0]  # [D, q]
        out[lo:hi] = torch.nn.functional.silu(y).t().to(x.dtype)
        if tail_states is not None:
            q, num_tail = hi - lo, tail_states.shape[1]
            for j in range(num_tail):
                end = q - num_tail + 1 + j  # tokens consumed
                if end >= 0:
                    tail_states[row, j] = full[:, end : end + k - 1].to(tail_states.dtype)
        for end, pool_slot in by_row[row]:  # the state after `end` tokens: inputs end-(K-1) .. end-1
            snapshot_pool[pool_slot] = full[:, end : end + k - 1].to(snapshot_pool.dtype)  # type: ignore[index]
        conv_state[slot] = full[:, -(k - 1) :].to(conv_state.dtype)
    return out


@triton.jit
def _causal_conv1d_varlen_kernel(
    x_ptr,
    x_stride,  # [T, D]
    w_ptr,  # [D, K] contiguous
    bias_ptr,  # [D] (unused without HAS_BIAS)
    state_ptr,
    state_stride,  # [S, D, K-1] contiguous in the last two dims
    idx_mapping_ptr,
    qsl_ptr,
    out_ptr,
    out_stride,  # [T, D]
    tail_ptr,
    tail_row_stride,
    num_tail,  # [R, num_tail, D, K-1]
    snap_start_ptr,
    snap_tokens_ptr,
    snap_slot_ptr,  # SnapshotTargets: [R+1], [M], [M] int32
    pool_ptr,
    pool_stride,  # [P, D, K-1] snapshot pool
    dim,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_TAIL: tl.constexpr,
    STORE_SNAPSHOTS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = ch < dim
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    start = tl.load(qsl_ptr + row)
    q = tl.load(qsl_ptr + row + 1) - start
    state = state_ptr + slot * state_stride + ch * (K - 1)
    lane0 = tl.zeros([BLOCK_D], dtype=tl.int32)  # positions as vectors: masks need a tensor on both sides
    acc_bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc_bias = tl.load(bias_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    for t in range(0, q):
        acc = acc_bias
        for k in tl.static_range(K):
            p = lane0 + t - (K - 1) + k  # position in the row; negative = from the conv state
            from_x = tl.load(x_ptr + (start + p).to(tl.int64) * x_stride + ch, mask=cmask & (p >= 0), other=0.0)
            from_state = tl.load(state + (K - 1) + p, mask=cmask & (p < 0), other=0.0)
            w = tl.load(w_ptr + ch * K + k, mask=cmask, other=0.0).to(tl.float32)
            acc += w * (from_x.to(tl.float32) + from_state.to(tl.float32))
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (start + t).to(tl.int64) * out_stride + ch, y.to(out_ptr.dtype.element_ty), mask=cmask)
    if STORE_TAIL:
        # state after consuming `end` tokens = inputs at positions end-(K-1) .. end-1
        for j in range(0, num_tail):
            end = q - num_tail + 1 + j
            if end >= 0:
                for i in tl.static_range(K - 1):
                    p = lane0 + end - (K - 1) + i
                    v = tl.load(x_ptr + (start + p).to(tl.int64) * x_stride + ch, mask=cmask & (p >= 0), other=0.0)
                    v += tl.load(state + (K - 1) + p, mask=cmask & (p < 0), other=0.0)
                    dst = tail_ptr + row * tail_row_stride + j * dim * (K - 1) + ch * (K - 1) + i
                    tl.store(dst, v.to(tail_ptr.dtype.element_ty), mask=cmask)
    if STORE_SNAPSHOTS:  # as the tails, at the requested token counts, into the pool (before the state moves)
        for j in range(tl.load(snap_start_ptr + row), tl.load(snap_start_ptr + row + 1)):
            end = tl.load(snap_tokens_ptr + j)
            dst = pool_ptr + tl.load(snap_slot_ptr + j).to(tl.int64) * pool_stride + ch * (K - 1)
            for i in tl.static_range(K - 1):
                p = lane0 + end - (K - 1) + i
                v = tl.load(x_ptr + (start + p).to(tl.int64) * x_stride + ch, mask=cmask & (p >= 0), other=0.0)
                v += tl.load(state + (K - 1) + p, mask=cmask & (p < 0), other=0.0)
                tl.store(dst + i, v.to(pool_ptr.dtype.element_ty), mask=cmask)
    # In place, in increasing i: new[i] reads old[i + q] (q >= 1), which no earlier iteration has overwritten.
    for i in tl.static_range(K - 1):
        p = lane0 + q - (K - 1) + i
        v = tl.load(x_ptr + (start + p).to(tl.int64) * x_stride + ch, mask=cmask & (p >= 0), other=0.0)
        v += tl.load(state + (K - 1) + p, mask=cmask & (p < 0), other=0.0)
        tl.store(state + i, v.to(state_ptr.dtype.element_ty), mask=cmask)


def causal_conv1d_varlen_triton(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D, K]
    bias: Optional[torch.Tensor],  # [D]
    conv_state: torch.Tensor,  # [S, D, K-1] by req_slot, updated in place
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    query_start_loc: torch.Tensor,  # [R+1] int32
    tail_states: Optional[torch.Tensor] = None,  # [R, num_tail, D, K-1]
    snapshots: Optional[SnapshotTargets] = None,
    snapshot_pool: Optional[torch.Tensor] = None,  # [P, D, K-1] by snapshot slot
) -> torch.Tensor:
    """Triton version of `causal_conv1d_varlen_reference`: one program per (batch row, channel block)."""
    dim, k = weight.shape
    for name, t in (("conv_state", conv_state), ("snapshot_pool", snapshot_pool)):
        if t is not None and (t.shape[1:] != (dim, k - 1) or t.stride(2) != 1 or t.stride(1) != k - 1):
            raise ValueError(f"{name} must be contiguous [S, {dim}, {k - 1}], got {tuple(t.shape)}")
    if snapshots is not None and snapshot_pool is None:
        raise ValueError("snapshots need a snapshot_pool to store into")
    out = torch.empty_like(x)
    rows = idx_mapping.numel()
    if rows == 0:
        return out
    weight = weight.contiguous()
    tail = tail_states if tail_states is not None else out
    block_d = min(256, next_power_of_2(dim))
    while block_d > 32 and rows * cdiv(dim, block_d) < 256:  # few rows: more, narrower programs
        block_d //= 2
    _causal_conv1d_varlen_kernel[(rows, cdiv(dim, block_d))](
        x,
        x.stride(0),
        weight,
        bias if bias is not None else weight,
        conv_state,
        conv_state.stride(0),
        idx_mapping,
        query_start_loc,
        out,
        out.stride(0),
        tail,
        tail.stride(0) if tail_states is not None else 0,
        tail_states.shape[1] if tail_states is not None else 0,
        *(snapshots if snapshots is not None else (idx_mapping,) * 3),
        snapshot_pool if snapshot_pool is not None else conv_state,
        snapshot_pool.stride(0) if snapshot_pool is not None else 0,
        dim,
        K=k,
        HAS_BIAS=bias is not None,
        STORE_TAIL=tail_states is not None,
        STORE_SNAPSHOTS=snapshots is not None,
        BLOCK_D=block_d,
    )
    return out


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    tail_states: Optional[torch.Tensor] = None,
    snapshots: Optional[SnapshotTargets] = None,
    snapshot_pool: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dispatch: Triton for CUDA tensors, the reference elsewhere (same arguments and result)."""
    fn = causal_conv1d_varlen_triton if x.is_cuda else causal_conv1d_varlen_reference
    return fn(x, weight, bias, conv_state, idx_mapping, query_start_loc, tail_states, snapshots, snapshot_pool)
