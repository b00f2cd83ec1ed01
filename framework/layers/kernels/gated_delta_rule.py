"""The gated delta rule (Gated DeltaNet linear attention) over a varlen batch, on per-slot recurrent state.

Each value head keeps a `[Dk, Dv]` float32 state `S`. A token with (L2-normed) key `k`, query `q` (scaled by
`Dk ** -0.5`), value `v`, log decay `g <= 0` and write strength `beta` in (0, 1) does

    S <- exp(g) * S;   u = beta * (v - S^T k);   S <- S + k u^T;   o = S^T q

Key/query heads may be fewer than value heads (grouped: value head `h` reads key head `h // (H / Hk)`).

As with the Mamba kernels, a row continues from its slot's state (`idx_mapping`: batch_row -> req_slot) and
leaves it advanced, so prefill chunks, decode steps and draft verification share one entry point; with
`tail_states` the state after each of a row's last `num_tail` tokens is also written (speculative decoding keeps
the accepted one), and with `snapshots` the state after given token counts goes to a snapshot pool (prefix
caching at block boundaries, `framework.layers.kernels.state_snapshots`).

Three forms compute the same thing:
- `gated_delta_rule_varlen_reference`: token by token in PyTorch (the definition the others are tested against);
- `gated_delta_rule_varlen_chunked`: PyTorch, chunks of `chunk_size` tokens at once (the prefill form on the
  CPU: a row is cut at its snapshot and tail points, each piece is processed chunk by chunk);
- `gated_delta_rule_varlen_triton`: one fused Triton program per (row, value head, block of Dv) stepping through
  the row's tokens (decode and verification on the GPU);
- `chunk_gated_delta_rule_varlen_triton` (`framework.layers.kernels.gated_delta_rule_chunk`): the chunked form in
  Triton, 64 tokens at a time as matrix products (prefill and mixed steps on the GPU).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.backend import launch_compiles
from framework.layers.kernels.gated_delta_rule_chunk import (
    check_state_arguments,
    chunk_gated_delta_rule_varlen_triton,
)
from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from framework.layers.kernels.state_snapshots import SnapshotTargets, snapshots_by_row

# On the GPU, steps whose rows average at least this many tokens (one 64-token chunk) take the chunked kernel; below
# it the per-chunk matrix work outweighs the recurrent kernel's token steps. On an H100 at Qwen3.5's heads
# (`benchmarks/gdn/bench_gdn_prefill.py`): 16 tokens a row, recurrent 2.3 ms against chunked 5.3; 128 tokens a
# row, recurrent 4.3 against 2.4.
CHUNK_MIN_TOKENS_PER_ROW = 64


class DeltaRuleInputs(NamedTuple):
    """One step's per-token inputs of a Gated DeltaNet layer (rows flattened)."""

    q: torch.Tensor  # [T, Hk, Dk] model dtype, not yet L2-normed
    k: torch.Tensor  # [T, Hk, Dk] model dtype, not yet L2-normed
    v: torch.Tensor  # [T, H, Dv] model dtype
    g: torch.Tensor  # [T, H] float32: log of the state's decay at this token (<= 0)
    beta: torch.Tensor  # [T, H] float32: write strength


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prepared(inp: DeltaRuleInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) float32, L2-normed, q scaled, key heads repeated to the value heads: [T, H, Dk] each."""
    groups = inp.v.shape[1] // inp.k.shape[1]
    q = _l2norm(inp.q.float()) * inp.q.shape[-1] ** -0.5
    k = _l2norm(inp.k.float())
    return q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)


def _row_cuts(q_len: int, num_tail: int, snaps: list[tuple[int, int]]) -> list[int]:
    """Token counts after which a row's state is needed (tails and snapshots), ascending, ending at q_len."""
    cuts = {end for end, _ in snaps if 0 < end <= q_len}
    cuts.update(q_len - num_tail + 1 + j for j in range(num_tail) if q_len - num_tail + 1 + j > 0)
    cuts.add(q_len)
    return sorted(cuts)


def _store_points(
    row: int,
    consumed: int,
    h: torch.Tensor,
    q_len: int,
    tail_states: Optional[torch.Tensor],
    snaps: list[tuple[int, int]],
    snapshot_pool: Optional[torch.Tensor],
) -> None:
    """Store `h` (the row's state after `consumed` tokens) into the tails and snapshots that ask for it."""
    if tail_states is not None and consumed > 0:  # (a row shorter than the tail leaves its first entries)
        j = consumed - q_len + tail_states.shape[1] - 1
        if 0 <= j < tail_states.shape[1]:
            tail_states[row, j] = h
    for end, pool_slot in snaps:
        if end == consumed:
            snapshot_pool[pool_slot] = h  # type: ignore[index]


def gated_delta_rule_varlen_reference(
    inp: DeltaRuleInputs,
    state: torch.Tensor,  # [S, H, Dk, Dv] float32 by req_slot, updated in place
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    query_start_loc: torch.Tensor,  # [R+1] int32: first token of each row
    tail_states: Optional[torch.Tensor] = None,  # [R, num_tail, H, Dk, Dv] float32
    snapshots: Optional[SnapshotTargets] = None,
    snapshot_pool: Optional[torch.Tensor] = None,  # [P, H, Dk, Dv] float32 by snapshot slot
) -> torch.Tensor:
    """[T, H, Dv] outputs in the value dtype, token by token; every row's slot state advances by its tokens."""
    q, k = _prepared(inp)
    v, g, beta = inp.v.float(), inp.g.float(), inp.beta.float()
    out = torch.empty_like(v)
    starts = query_start_loc.tolist()
    by_row = snapshots_by_row(snapshots, snapshot_pool, idx_mapping.numel())
    for row, slot in enumerate(idx_mapping.tolist()):
        lo, hi = starts[row], starts[row + 1]
        h = state[slot].float().clone()  # [H, Dk, Dv]
        _store_points(row, 0, h, hi - lo, tail_states, by_row[row], snapshot_pool)
        for t in range(lo, hi):
            h = h * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", h, k[t]))
            h = h + k[t][:, :, None] * u[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", h, q[t])
            _store_points(row, t - lo + 1, h, hi - lo, tail_states, by_row[row], snapshot_pool)
        state[slot] = h
    return out.to(inp.v.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [N, H, Dk] float32, prepared (normed, scaled, heads repeated)
    k: torch.Tensor,  # [N, H, Dk] float32, prepared
    v: torch.Tensor,  # [N, H, Dv] float32
    g: torch.Tensor,  # [N, H] float32
    beta: torch.Tensor,  # [N, H] float32
    h0: torch.Tensor,  # [H, Dk, Dv] float32: the state before the first token
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [N, H, Dv], state after the last token) of one sequence, `chunk_size` tokens at a time.

    Inside a chunk, with cumulative log decay `c_t` and `D[t, j] = exp(c_t - c_j)` (j <= t), the corrections
    `u` solve the unit lower-triangular system `(I + A) u = beta v - beta exp(c) K h0` with
    `A[t, j] = beta_t D[t, j] (k_t . k_j)` for j < t; then `o = exp(c) Q h0 + (D * Q K^T) u` and the state
    after the chunk is `exp(c_last) h0 + (exp(c_last - c) K)^T u`.
    """
    outs = []
    h = h0
    for lo in range(0, q.shape[0], chunk_size):
        qc, kc, vc = (x[lo : lo + chunk_size].transpose(0, 1) for x in (q, k, v))  # [H, C, D]
        gc, bc = g[lo : lo + chunk_size].t(), beta[lo : lo + chunk_size].t()  # [H, C]
        n = gc.shape[1]
        c = gc.cumsum(-1)  # [H, C]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (c[:, :, None] - c[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, C, C]
        a = (bc[:, :, None] * decay * (kc @ kc.transpose(1, 2))).tril(-1)
        a = a + torch.eye(n, dtype=a.dtype, device=a.device)  # I + A, unit lower triangular
        rhs = torch.cat([bc[:, :, None] * vc, (bc * c.exp())[:, :, None] * kc], dim=-1)
        solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        w, y = solved[..., : vc.shape[-1]], solved[..., vc.shape[-1] :]
        u = w - y @ h  # [H, C, Dv]
        o = c.exp()[:, :, None] * (qc @ h) + (decay * (qc @ kc.transpose(1, 2))) @ u
        outs.append(o.transpose(0, 1))
        last = c[:, -1:]  # [H, 1]
        h = last.exp()[:, :, None] * h + ((last - c).exp()[:, :, None] * kc).transpose(1, 2) @ u
    return torch.cat(outs, dim=0), h


def gated_delta_rule_varlen_chunked(
    inp: DeltaRuleInputs,
    state: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    tail_states: Optional[torch.Tensor] = None,
    snapshots: Optional[SnapshotTargets] = None,
    snapshot_pool: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """`gated_delta_rule_varlen_reference`'s result (same arguments), each row's pieces between the points
    where a state is stored computed chunk by chunk."""
    q, k = _prepared(inp)
    v, g, beta = inp.v.float(), inp.g.float(), inp.beta.float()
    out = torch.empty_like(v)
    starts = query_start_loc.tolist()
    num_tail = tail_states.shape[1] if tail_states is not None else 0
    by_row = snapshots_by_row(snapshots, snapshot_pool, idx_mapping.numel())
    for row, slot in enumerate(idx_mapping.tolist()):
        lo, hi = starts[row], starts[row + 1]
        h = state[slot].float()
        _store_points(row, 0, h, hi - lo, tail_states, by_row[row], snapshot_pool)
        done = 0
        for cut in _row_cuts(hi - lo, num_tail, by_row[row]):
            a, b = lo + done, lo + cut
            out[a:b], h = chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], h, chunk_size)
            done = cut
            _store_points(row, done, h, hi - lo, tail_states, by_row[row], snapshot_pool)
        state[slot] = h
    return out.to(inp.v.dtype)


def gated_delta_rule_decode_reference(
    inp: DeltaRuleInputs,  # one token per row: T = R
    state: torch.Tensor,  # [S, H, Dk, Dv] float32 by req_slot
    idx_mapping: torch.Tensor,  # [R] int32
) -> torch.Tensor:
    """[R, H, Dv]: one token per row, all rows at once (the CPU decode step)."""
    q, k = _prepared(inp)
    slots = idx_mapping.long()
    h = state[slots] * inp.g.float().exp()[:, :, None, None]  # [R, H, Dk, Dv]
    u = inp.beta.float()[:, :, None] * (inp.v.float() - torch.einsum("rhkv,rhk->rhv", h, k))
    h = h + k[:, :, :, None] * u[:, :, None, :]
    state[slots] = h
    return torch.einsum("rhkv,rhk->rhv", h, q).to(inp.v.dtype)


# ---- Triton --------------------------------------------------------------------------------------------------


@triton.jit
def _gated_delta_rule_kernel(
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
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    kmask, vmask = ks < dk, vs < dv
    mask2 = kmask[:, None] & vmask[None, :]
    k_head = head // (num_heads // num_k_heads)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    start = tl.load(qsl_ptr + row).to(tl.int64)
    end = tl.load(qsl_ptr + row + 1).to(tl.int64)
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
    for tok in range(start, end):
        qk_base = (tok * num_k_heads + k_head) * dk
        q = tl.load(q_ptr + qk_base + ks, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_base + ks, mask=kmask, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + (tok * num_heads + head) * dv + vs, mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok * num_heads + head)
        beta = tl.load(beta_ptr + tok * num_heads + head)
        h = h * tl.exp(g)
        u = beta * (v - tl.sum(h * k[:, None], axis=0))
        h = h + k[:, None] * u[None, :]
        o = tl.sum(h * q[:, None], axis=0)
        tl.store(out_ptr + (tok * num_heads + head) * dv + vs, o.to(out_ptr.dtype.element_ty), mask=vmask)
        if STORE_TAIL:
            j = tok - end + num_tail
            if j >= 0:
                tl.store(tail_ptr + row * tail_row_stride + j * num_heads * head_tile + tile, h, mask=mask2)
        if STORE_SNAPSHOTS:
            if tok - start + 1 == snap_at:
                tl.store(pool_ptr + tl.load(snap_slot_ptr + snap).to(tl.int64) * pool_stride + tile, h, mask=mask2)
                snap += 1
                snap_at = tl.load(snap_tokens_ptr + snap, mask=snap < snap_end, other=-1)
    tl.store(state_ptr + slot * state_stride + tile, h, mask=mask2)


def gated_delta_rule_varlen_triton(
    inp: DeltaRuleInputs,
    state: torch.Tensor,  # [S, H, Dk, Dv] float32, contiguous per slot
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    query_start_loc: torch.Tensor,  # [R+1] int32
    tail_states: Optional[torch.Tensor] = None,  # [R, num_tail, H, Dk, Dv] float32
    snapshots: Optional[SnapshotTargets] = None,
    snapshot_pool: Optional[torch.Tensor] = None,  # [P, H, Dk, Dv] float32
) -> torch.Tensor:
    """[T, H, Dv]: `gated_delta_rule_varlen_reference` in one launch (grid: rows x value heads x Dv blocks)."""
    t, num_k_heads, dk = inp.k.shape
    num_heads, dv = inp.v.shape[1:]
    check_state_arguments(state, num_heads, num_k_heads, dk, dv, snapshots, snapshot_pool)
    q, k, v = inp.q.contiguous(), inp.k.contiguous(), inp.v.contiguous()
    g, beta = inp.g.float().contiguous(), inp.beta.float().contiguous()
    out = torch.empty_like(v)
    rows = idx_mapping.numel()
    if rows == 0:
        return out
    block_k = next_power_of_2(dk)
    block_v = min(next_power_of_2(dv), max(16, 8192 // block_k))  # the [Dk, BLOCK_V] tile stays in registers
    dummy = state  # unused pointer arguments when a feature is off
    snap = snapshots if snapshots is not None else (idx_mapping, idx_mapping, idx_mapping)
    _gated_delta_rule_kernel[(rows, num_heads, cdiv(dv, block_v))](
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
        tail_states if tail_states is not None else dummy,
        tail_states.stride(0) if tail_states is not None else 0,
        tail_states.shape[1] if tail_states is not None else 0,
        snap[0],
        snap[1],
        snap[2],
        snapshot_pool if snapshot_pool is not None else dummy,
        snapshot_pool.stride(0) if snapshot_pool is not None else 0,
        num_heads,
        num_k_heads,
        dk,
        dv,
        dk**-0.5,
        STORE_TAIL=tail_states is not None,
        STORE_SNAPSHOTS=snapshots is not None,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
    )
    return out


def gated_delta_rule_varlen(
    inp: DeltaRuleInputs,
    state: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    tail_states: Optional[torch.Tensor] = None,
    snapshots: Optional[SnapshotTargets] = None,
    snapshot_pool: Optional[torch.Tensor] = None,
    pure_decode: bool = False,
) -> torch.Tensor:
    """Dispatch. On CUDA: the chunked Triton kernel when the rows average at least `CHUNK_MIN_TOKENS_PER_ROW`
    tokens (prefill and prefill-heavy mixed steps; host-known shapes only), else the recurrent one (decode,
    verification). On the CPU: the batched one-step update for a pure decode batch (one token per row, no tails
    or snapshots), else the chunked PyTorch form."""
    if inp.v.is_cuda:
        warm_delta_rule_variants(inp, state)
        if not pure_decode and inp.v.shape[0] >= CHUNK_MIN_TOKENS_PER_ROW * idx_mapping.numel():
            return chunk_gated_delta_rule_varlen_triton(
                *inp, state, idx_mapping, query_start_loc, tail_states, snapshots, snapshot_pool
            )
        return gated_delta_rule_varlen_triton(
            inp, state, idx_mapping, query_start_loc, tail_states, snapshots, snapshot_pool
        )
    if pure_decode and tail_states is None and snapshots is None:
        return gated_delta_rule_decode_reference(inp, state, idx_mapping)
    return gated_delta_rule_varlen_chunked(
        inp, state, idx_mapping, query_start_loc, tail_states, snapshots, snapshot_pool
    )


# What this process has compiled ahead (`warm_delta_rule_variants`): per device, dtype and head geometry. A record
# like Triton's own kernel cache, which it mirrors; never cleared.
_WARMED: set[tuple] = set()


def warm_delta_rule_variants(inp: DeltaRuleInputs, state: torch.Tensor) -> None:
    """Compile both delta-rule kernels with and without tails and snapshots at a geometry's first eager launch on a
    GPU, on a one-row batch of zero tokens in scratch buffers.

    Which variant a step takes depends on its rows: a mixed step of decode rows and short prefill chunks that ends a
    block takes the recurrent kernel with snapshots, which neither a warm-up's prefill nor its decode graphs run, so
    without this it compiled inside a served step (seen in the Qwen3.5 nano benchmark). Nothing on the CPU or while
    a CUDA graph is captured (the next eager launch warms)."""
    device = inp.v.device
    _, num_k_heads, dk = inp.k.shape
    num_heads, dv = inp.v.shape[1:]
    key = (device, inp.v.dtype, num_k_heads, dk, num_heads, dv)
    if key in _WARMED or not _may_compile(device):
        return
    _WARMED.add(key)

    def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    one = DeltaRuleInputs(
        zeros(1, num_k_heads, dk, dtype=inp.q.dtype), zeros(1, num_k_heads, dk, dtype=inp.k.dtype),
        zeros(1, num_heads, dv, dtype=inp.v.dtype), zeros(1, num_heads), zeros(1, num_heads),
    )  # fmt: skip
    scratch = zeros(1, num_heads, dk, dv)
    rows = (zeros(1, dtype=torch.int32), zeros(2, dtype=torch.int32))  # idx_mapping, query_start_loc: no tokens
    targets = SnapshotTargets(zeros(2, dtype=torch.int32), zeros(1, dtype=torch.int32), zeros(1, dtype=torch.int32))
    for tails in (None, zeros(1, 2, num_heads, dk, dv)):
        for snapshots in (None, targets):
            pool = scratch if snapshots is not None else None
            gated_delta_rule_varlen_triton(one, scratch, *rows, tails, snapshots, pool)
            chunk_gated_delta_rule_varlen_triton(*one, scratch, *rows, tails, snapshots, pool)


_may_compile = launch_compiles  # a module attribute: tests stand a CPU in for a GPU through it
