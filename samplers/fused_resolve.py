"""How the fused sampling path (see `samplers.fused_sampling`) ends each logits row.

`_fused_resolve_kernel` (one program per row, small: all rows run at once): direct rows merge the per-chunk
Gumbel (or greedy) argmaxes of the sample kernel; gather rows are sampled from the candidates the plan
gathered (`_resolve_candidates`), or by the slow path below.

`_resolve_candidates` resolves a gather row from its candidates exactly: for
candidate i, `greater_i` and `mass_i` are the count and the mass `sum(exp(y_j - max))` of the candidates
strictly larger than it (pairwise, in tiles; masses in 40-bit fixed point so the sum does not depend on the
buffer's order), then

    top-k:  greater_i < k                   (i.e. y_i >= the k-th largest, ties kept)
    Z:      sum of exp(y_i - max) over top-k survivors, or the row's sum-exp without top-k
    top-p:  mass_i < p * Z                  (tie groups kept or dropped whole)
    min-p:  exp(y_i - max) >= min_p
    token:  argmax of y_i + gumbel(seed, position, token) over kept candidates, lowest id on ties

A row whose candidates overflowed the buffer, or whose top-p set may extend below them, is sampled by
`_exact_row_sample`: the thresholds of the top-k/top-p kernel (`_top_k_top_p_threshold`: bisection over the
whole row, 33 counting passes per threshold), then a Gumbel pass. Slow, exact, and needed only by unusual rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from samplers.gumbel import _gumbel_noise, _row_key
from samplers.top_k_top_p import _load_scaled, _ordered_key, _top_k_top_p_threshold

FIXED_ONE = tl.constexpr(1099511627776.0)  # 2**40: fixed-point scale of the masses (a constexpr: read by kernels)
WIN = tl.constexpr(21.0)  # a token more than this below the row max never wins: Gumbel noise spans 20.19


@triton.jit
def _compare_tile(cand_x, i0, n, temp, row_max, TILE_I: tl.constexpr, TILE_J: tl.constexpr):
    """For candidates i0 .. i0 + TILE_I: (#candidates with a larger y, their fixed-point mass, y, own weight)."""
    rows = i0 + tl.arange(0, TILE_I)
    v_i = tl.math.div_rn(tl.load(cand_x + rows, mask=rows < n, other=-float("inf")), temp)
    w_i = (tl.where(rows < n, tl.exp(v_i - row_max), 0.0) * FIXED_ONE).to(tl.int64)
    greater = tl.zeros([TILE_I], dtype=tl.int32)
    mass = tl.zeros([TILE_I], dtype=tl.int64)
    for j0 in range(0, n, TILE_J):
        cols = j0 + tl.arange(0, TILE_J)
        v_j = tl.math.div_rn(tl.load(cand_x + cols, mask=cols < n, other=-float("inf")), temp)
        w_j = (tl.where(cols < n, tl.exp(v_j - row_max), 0.0) * FIXED_ONE).to(tl.int64)
        above = v_j[None, :] > v_i[:, None]  # [TILE_I, TILE_J]
        greater += tl.sum(above.to(tl.int32), axis=1)
        mass += tl.sum(tl.where(above, w_j[None, :], 0), axis=1)
    return greater, mass, v_i, w_i


@triton.jit
def _exact_row_sample(
    row_ptr, temp, k_on, k, p_on, p, min_p, key, vocab_size, SANITIZE: tl.constexpr, BLOCK: tl.constexpr
):
    """(token, its score) for one row straight from the logits: the top-k/top-p kernel's thresholds, then
    Gumbel-max."""
    threshold, row_max = _top_k_top_p_threshold(row_ptr, temp, k_on, k, p_on, p, vocab_size, SANITIZE, BLOCK)
    best_value = tl.full([], -float("inf"), tl.float32)
    best_token = tl.zeros([], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        y = _load_scaled(row_ptr, offs, vocab_size, temp, SANITIZE)
        keep = (offs < vocab_size) & (_ordered_key(y).to(tl.int64) >= threshold) & (y > -float("inf"))
        if min_p > 0.0:
            keep = keep & (tl.exp(y - row_max) >= min_p)
        score = tl.where(keep, y + _gumbel_noise(key, offs), -float("inf"))
        block_best = tl.max(score, axis=0)
        take = block_best > best_value
        best_token = tl.where(take, start + tl.argmax(score, axis=0, tie_break_left=True), best_token)
        best_value = tl.where(take, block_best, best_value)
    return best_token, best_value


@triton.jit
def _pick(greater, mass, v_i, rows, n, cand_t, z, row_max, k_on, k, p_on, p, min_p, key):
    """(best score, its token, #candidates top-p dropped) of one tile of candidates, by the rules above."""
    t_i = tl.load(cand_t + rows, mask=rows < n, other=0)
    keep = rows < n
    if k_on:
        keep = keep & (greater < k)
    num_dropped = tl.zeros([], dtype=tl.int32)
    if p_on:
        in_p = mass.to(tl.float32) * (1.0 / FIXED_ONE) < p * z
        num_dropped = tl.sum((keep & ~in_p).to(tl.int32), axis=0)
        keep = keep & in_p
    if min_p > 0.0:
        keep = keep & (tl.exp(v_i - row_max) >= min_p)
    score = tl.where(keep, v_i + _gumbel_noise(key, t_i), -float("inf"))
    tile_best = tl.max(score, axis=0)
    tile_token = tl.min(tl.where(keep & (score == tile_best), t_i, 2147483647), axis=0)
    return tile_best, tile_token, num_dropped


@triton.jit
def _resolve_candidates(
    cand_x,
    cand_t,
    n,
    temp,
    row_max,
    row_sum,
    cutoff,
    k_on,
    k,
    p_on,
    p,
    min_p,
    key,
    TILE_I: tl.constexpr,
    TILE_J: tl.constexpr,
):
    """(token, its score, exact) of a gather row from its n <= CAP candidates (x at cand_x, ids at cand_t);
    `exact` is 0 when top-p alone kept every candidate and tokens below them might still win."""
    best_value = tl.full([], -float("inf"), tl.float32)
    best_token = tl.zeros([], dtype=tl.int32)
    num_dropped = tl.zeros([], dtype=tl.int32)
    if n <= TILE_I:  # one tile (k up to about TILE_I): its pairwise counts serve Z and the rules both
        greater, mass, v_i, w_i = _compare_tile(cand_x, 0, n, temp, row_max, TILE_I, TILE_J)
        z = row_sum
        if k_on & p_on:
            z = tl.sum(tl.where(greater < k, w_i, 0), axis=0).to(tl.float32) * (1.0 / FIXED_ONE)
        best_value, best_token, num_dropped = _pick(
            greater, mass, v_i, tl.arange(0, TILE_I), n, cand_t, z, row_max, k_on, k, p_on, p, min_p, key
        )
        best_token = tl.where(best_value > -float("inf"), best_token, 0)
    else:
        # Z: the row's sum-exp for top-p alone, else the mass of the top-k survivors (all candidates).
        z = row_sum
        if k_on & p_on:
            z_fixed = tl.zeros([], dtype=tl.int64)
            for i0 in range(0, n, TILE_I):
                greater, unused_mass, v_i, w_i = _compare_tile(cand_x, i0, n, temp, row_max, TILE_I, TILE_J)
                z_fixed += tl.sum(tl.where(greater < k, w_i, 0), axis=0)
            z = z_fixed.to(tl.float32) * (1.0 / FIXED_ONE)
        for i0 in range(0, n, TILE_I):
            greater, mass, v_i, unused_w = _compare_tile(cand_x, i0, n, temp, row_max, TILE_I, TILE_J)
            tile_best, tile_token, tile_dropped = _pick(
                greater, mass, v_i, i0 + tl.arange(0, TILE_I), n, cand_t, z, row_max, k_on, k, p_on, p, min_p, key
            )
            num_dropped += tile_dropped
            take = (tile_best > best_value) | ((tile_best == best_value) & (tile_token < best_token))
            best_token = tl.where(take & (tile_best > -float("inf")), tile_token, best_token)
            best_value = tl.where(take, tile_best, best_value)
    exact = tl.full([], 1, tl.int1)
    if (k_on == 0) & (num_dropped == 0):
        # Top-p alone kept every candidate: are the tokens below the cutoff out of reach?
        lowest = tl.math.div_rn(cutoff, temp)  # >= y of every other token
        exact = (lowest == -float("inf")) | (lowest <= row_max - WIN)
    return best_token, best_value, exact


@triton.jit
def _row_nonfinite(nonfinite_ptr, part_bad_ptr, logits_row, num_chunks, HAS_FLAGS: tl.constexpr, CHUNKS: tl.constexpr):
    """Whether the row had NaN/+inf: the caller's flag, or the per-chunk counts of the first pass."""
    if HAS_FLAGS:
        nonfinite = tl.load(nonfinite_ptr + logits_row).to(tl.int32) != 0
    else:
        chunks = tl.arange(0, CHUNKS)
        bad = tl.load(part_bad_ptr + logits_row * num_chunks + chunks, mask=chunks < num_chunks, other=0)
        nonfinite = tl.sum(bad, axis=0) > 0
    return nonfinite


@triton.jit
def _store_result(
    sampled_ptr,
    errors_ptr,
    logits_row,
    best_token,
    best_value,
    nonfinite,
    NONFINITE_CODE: tl.constexpr,
    NO_TOKEN_CODE: tl.constexpr,
):
    no_token = best_value == -float("inf")
    best_token = tl.where(no_token, 0, best_token)
    tl.store(sampled_ptr + logits_row, best_token.to(tl.int64))
    tl.store(errors_ptr + logits_row, tl.where(nonfinite, NONFINITE_CODE, tl.where(no_token, NO_TOKEN_CODE, 0)))


@triton.jit(do_not_specialize=["num_chunks"])  # per-step sizes: no recompiles mid-run
def _fused_resolve_kernel(
    logits_ptr,
    logits_stride,
    idx_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    positions_ptr,
    count_ptr,
    row_max_ptr,
    row_sum_ptr,
    cutoff_ptr,
    cand_value_ptr,
    cand_token_ptr,
    part_best_ptr,
    part_token_ptr,
    part_bad_ptr,
    nonfinite_ptr,
    sampled_ptr,
    errors_ptr,
    num_chunks,
    vocab_size,
    SANITIZE: tl.constexpr,
    HAS_FLAGS: tl.constexpr,
    NONFINITE_CODE: tl.constexpr,
    NO_TOKEN_CODE: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr = 2048,
    TILE_I: tl.constexpr = 64,
    TILE_J: tl.constexpr = 64,
):
    logits_row = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(idx_ptr + logits_row).to(tl.int64)
    temp = tl.load(temp_ptr + req_slot)
    random = temp != 0.0
    temp = tl.where(random, temp, 1.0)
    k = tl.load(top_k_ptr + req_slot)
    p = tl.load(top_p_ptr + req_slot)
    min_p = tl.where(random, tl.load(min_p_ptr + req_slot), 0.0)
    k_on = random & (k > 0) & (k < vocab_size)
    p_on = random & (p < 1.0)
    best_value = tl.full([], -float("inf"), tl.float32)
    best_token = tl.zeros([], dtype=tl.int32)
    if k_on | p_on:  # a gather row: its candidates, else (overflow, or not provably exact) the slow path
        key = _row_key(tl.load(seed_ptr + req_slot), tl.load(positions_ptr + logits_row))
        n = tl.load(count_ptr + logits_row)
        exact = tl.zeros([], dtype=tl.int1)
        if n <= CAP:
            best_token, best_value, exact = _resolve_candidates(
                cand_value_ptr + logits_row * CAP,
                cand_token_ptr + logits_row * CAP,
                n,
                temp,
                tl.load(row_max_ptr + logits_row),
                tl.load(row_sum_ptr + logits_row),
                tl.load(cutoff_ptr + logits_row),
                k_on,
                k,
                p_on,
                p,
                min_p,
                key,
                TILE_I,
                TILE_J,
            )
        if exact == 0:
            row_ptr = logits_ptr + logits_row * logits_stride
            best_token, best_value = _exact_row_sample(
                row_ptr, temp, k_on, k, p_on, p, min_p, key, vocab_size, SANITIZE, BLOCK
            )
    else:  # a direct row: merge the sample kernel's per-chunk argmaxes
        chunks = tl.arange(0, CHUNKS)
        in_row = chunks < num_chunks
        part_best = tl.load(part_best_ptr + logits_row * num_chunks + chunks, mask=in_row, other=-float("inf"))
        part_token = tl.load(part_token_ptr + logits_row * num_chunks + chunks, mask=in_row, other=2147483647)
        best_value = tl.max(part_best, axis=0)
        best_token = tl.min(tl.where(part_best == best_value, part_token, 2147483647), axis=0)
    nonfinite = _row_nonfinite(nonfinite_ptr, part_bad_ptr, logits_row, num_chunks, HAS_FLAGS, CHUNKS)
    _store_result(sampled_ptr, errors_ptr, logits_row, best_token, best_value, nonfinite, NONFINITE_CODE, NO_TOKEN_CODE)
