"""Stages 8-12 of the sampler fused: temperature, top-k, top-p, min-p and Gumbel-max in one or two reads.

The result is the reference's (`samplers.reference.sample_reference`: temperature, `apply_top_k_top_p_reference`,
`apply_min_p_reference`, `gumbel_sample_reference`, or the argmax for greedy rows), token for token, with the
kept-set semantics and tie rules of `samplers.top_k_top_p`. The logits are only read, in float32 or in the
model's dtype: bf16/fp16 logits are widened to float32 in registers as they are loaded (exact, NaN and +inf
kept), so they give the tokens of their `.float()` copy without that copy. Write `y = x / T`.

- **Direct rows** (greedy, or neither top-k nor top-p): `_fused_sample_kernel` takes the argmax of
  `y + gumbel(seed, position, token)` (greedy: of `x`) over the tokens min-p keeps, per vocabulary chunk;
  `_fused_resolve_kernel` merges the chunks (lowest token id on ties). One read (two with min-p, which needs
  the row max first).
- **Gather rows** (top-k and/or top-p), one read of the logits plus a read of the group maxima (1/GROUP of it):
  1. `_fused_stats_kernel` (rows x chunks) writes per chunk the max of x and, for top-p alone, the sum of
     `exp(y - max y)`; and the max of x of every `GROUP` consecutive tokens. A plain read: the penalties, if
     any, were applied before by their own kernel, which touches only the rows' seen tokens
     (`samplers.penalties`).
  2. `_fused_plan_kernel` (one program per row):
     a. picks a cutoff `c` on x such that `want <= G(c) <= limit`, with `G(c)` the number of groups whose max
        is `>= c`: a bisection over the order-preserving int keys of the group maxima, held in registers
        (`samplers.fused_cutoff`). `want` tokens are then `>= c`,
        so every token of the top-k set is; at most `GROUP * limit <= CAP` tokens are `>= c`. `want` is k
        (top-k), or `CAP / GROUP / 2` groups for top-p alone. `c` is lowered by a few ulps, as `x / T` may
        round a slightly smaller x to the same y.
     b. compacts the ids of the groups whose max is `>= c` (a prefix sum; per-row scratch of CAP ids).
     c. loads those groups' tokens, `CAP / GROUP` groups per tile, and compacts every finite one with
        `x >= c` (x, id) into a per-row buffer of `CAP` entries. The other groups' tokens are never loaded.
  3. `_fused_sample_kernel` skips gather rows (it is not launched when every row gathers, `all_gather`).
  4. `_fused_resolve_kernel` (one small program per row, all rows in one wave) samples each gather row from its
     candidates (`samplers.fused_resolve._resolve_candidates`): they are a top set of the row in y (division
     by T > 0 is monotone), so the count and the mass of strictly larger tokens, computed among them, are the
     row's. It applies the exact rules: top-k `#greater < k`, Z = mass of the top-k survivors (or the row's
     sum-exp for top-p alone), top-p `mass_greater < p * Z`, min-p `exp(y - max) >= min_p`, then the Gumbel
     argmax. Rows whose candidates overflowed, or that the candidates cannot settle, take the slow path (below).
     The plan, a big program per row (its group maxima sit in registers), ends at the gather: the resolve
     needs few registers, and in the plan it kept those big programs resident longer.

Exactness: the same kept set and the same noise per (seed, position, token) as the reference, so the same
token; ties at a threshold follow the reference's rule (top-k keeps every token tied with the k-th, top-p
keeps or drops a tie group whole, the lowest token id wins a tie of noisy scores). Masses are float sums in
a different order than the reference's, so a row whose top-p mass lies within float rounding (~1e-6) of
`p * Z` may keep one tie group more or less, as the unfused Triton kernel may. Masses are summed in 40-bit
fixed point, so the order of the candidates never changes a result.

Slow path: a row whose candidates overflow the buffer (k > CAP / GROUP with an unlucky spread, huge ties), or
a top-p-alone row whose candidates all pass top-p while tokens below the cutoff are within `WIN` of the row
max (flat rows, p close to 1: the kept set may extend below the candidates), is sampled by the resolve
kernel with the top-k/top-p kernel's thresholds (`samplers.top_k_top_p._top_k_top_p_threshold`: bisection
over the whole row, 33 passes per threshold), then a Gumbel pass: the same token, slower. A token more than
`WIN` = 21 below the row max can never win (the noise spans [-2.86, 17.34] and the row's most likely token is
always kept), so such tokens need not be candidates.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from samplers.fused_cutoff import _bisect_cutoff, _key_value
from samplers.fused_resolve import _fused_resolve_kernel
from samplers.gumbel import _gumbel_noise, _row_key
from samplers.reference import FusedSample, SlotSamplingParams, sample_reference
from samplers.top_k_top_p import _ordered_key
from samplers.triton_utils import use_triton, vocab_block

# Groups of 32 (H200, 256 x 151,936, k = 50: plan kernel 45-53 us against 60-70 us with groups of 16, the
# whole pipeline 117-125 against 130-146 us; docs/benchmarks.md): half the group maxima to search.
GROUP = 32  # tokens per group maximum written by pass 1
CAP = 2048  # candidate buffer entries per logits row (CAP / GROUP groups per gather tile)
# Launch shapes, H200, 256 x 151,936, k = 50 (docs/benchmarks.md; pipeline peaked / flat against one read
# of 57.7 us): 119.5 / 115.9 us with the first pass at 4 warps and 2048 programs, the plan at 16 warps and the
# resolve at 4; 100.5 / 97.9 us (1.75x) with 2 / 4096 / 8 warps capped at 128 registers (2 plans per SM: one
# wave of 256 rows) / 8. Each change alone: 112.3, 116.4, 110.8, 117.4 us peaked.
TARGET_PROGRAMS = 4096  # pass 1 and 2 split rows into chunks until about this many programs run
STATS_WARPS = 2  # warps of the first pass's programs
SAMPLE_WARPS = 8  # sample kernel: 8 warps ran temperature-only rows 5 % faster than 4 (H200, bench_sampler.py)
PLAN_WARPS = 8  # the plan holds a row's group maxima (8,192 padded at V = 151,936: 32 per thread) in registers
# The plan's cutoff search is a bisection: on an H200 it beat a radix select (plan kernel 71 against 102 us at
# 256 x 151,936: tl.histogram contends on the few busy bins of clustered keys) and the 4-way and value-guided
# splits tried after it (docs/benchmarks.md, "Third design"), which production never selected and are gone.
PLAN_MAXNREG: Optional[int] = 128  # a register cap for the plan kernel (None: the compiler's choice)
# Candidates per side of the resolve's pairwise tiles (rows with at most this many: one tile). H200, 256 x 151,936,
# k = 50: pipeline 119 / 115 us (peaked / flat) with 32, 150 / 145 with 64 (a 64 x 64 tile of int64 masses
# overflows the registers of a 4-warp program).
RESOLVE_TILE = 32
RESOLVE_WARPS = 8  # the resolve kernel samples gather rows from their candidates: small programs, one wave


# ---- Triton ------------------------------------------------------------------------------------------------


@triton.jit
def _row_filters(idx_ptr, temp_ptr, top_k_ptr, top_p_ptr, logits_row, vocab_size):
    """(req_slot, temperature, k_on, p_on, gather) of one logits row; greedy rows have neither filter."""
    req_slot = tl.load(idx_ptr + logits_row).to(tl.int64)
    temp = tl.load(temp_ptr + req_slot)
    random = temp != 0.0
    k = tl.load(top_k_ptr + req_slot)
    p = tl.load(top_p_ptr + req_slot)
    k_on = random & (k > 0) & (k < vocab_size)
    p_on = random & (p < 1.0)
    return req_slot, tl.where(random, temp, 1.0), k_on, p_on, k_on | p_on


@triton.jit
def _sanitized(x, SANITIZE: tl.constexpr):
    """(x, 1 in each lane holding a NaN/+inf (which SANITIZE turns into -inf), else 0). Per lane, not summed:
    a loop adds the lanes up and reduces once at its end, not once a block (a block-wide sum is a barrier)."""
    lane_bad = tl.zeros_like(x).to(tl.int32)
    if SANITIZE:
        bad = ~(x < float("inf"))  # NaN compares false
        lane_bad = bad.to(tl.int32)
        x = tl.where(bad, -float("inf"), x)
    return x, lane_bad


@triton.jit
def _load_x(row_ptr, offs, mask, SANITIZE: tl.constexpr):
    """(x in float32, -inf outside the row; per lane 1 where a NaN/+inf was, which SANITIZE turns into -inf).
    The row may be bf16/fp16 (the LM head's dtype): widened in registers, exactly, NaN and +inf kept."""
    return _sanitized(tl.load(row_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32), SANITIZE)


@triton.jit(do_not_specialize=["num_chunks", "chunk_size"])  # per-step sizes: no recompiles mid-run
def _fused_stats_kernel(
    logits_ptr,
    logits_stride,
    idx_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_bad_ptr,
    group_max_ptr,
    num_groups,
    num_chunks,
    chunk_size,
    vocab_size,
    SANITIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    # Maxima are taken over x, not y = x / T: division by T > 0 is monotone, so max(y) = max(x) / T, and the
    # division is left to the few values that need it.
    logits_row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    req_slot, temp, k_on, p_on, gather = _row_filters(idx_ptr, temp_ptr, top_k_ptr, top_p_ptr, logits_row, vocab_size)
    need_sum = p_on & (k_on == 0)  # Z of top-p alone is the whole row's sum-exp
    row_ptr = logits_ptr + logits_row * logits_stride
    run_max = tl.full([], -float("inf"), tl.float32)  # of x
    run_sum = tl.zeros([], dtype=tl.float32)  # sum of exp(y - run_max / T)
    lane_bad = tl.zeros([BLOCK], dtype=tl.int32)
    start0 = chunk * chunk_size
    for start in range(start0, tl.minimum(start0 + chunk_size, vocab_size), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, block_bad = _load_x(row_ptr, offs, offs < vocab_size, SANITIZE)
        lane_bad += block_bad
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        if need_sum & (new_max > -float("inf")):  # online sum-exp, relative to the running max
            y_max = tl.math.div_rn(new_max, temp)
            scale = tl.exp(tl.math.div_rn(run_max, temp) - y_max)
            run_sum = run_sum * scale + tl.sum(tl.exp(tl.math.div_rn(x, temp) - y_max), axis=0)
        run_max = new_max
        if gather:
            group_max = tl.max(tl.reshape(x, [BLOCK // GROUP, GROUP]), axis=1)
            groups = start // GROUP + tl.arange(0, BLOCK // GROUP)
            tl.store(group_max_ptr + logits_row * num_groups + groups, group_max, mask=groups < num_groups)
    tl.store(part_max_ptr + logits_row * num_chunks + chunk, run_max)
    tl.store(part_sum_ptr + logits_row * num_chunks + chunk, run_sum)
    if gather:  # pass 2 reads only candidate groups of these rows: the non-finite count is taken here
        tl.store(part_bad_ptr + logits_row * num_chunks + chunk, tl.sum(lane_bad, axis=0))


@triton.jit(do_not_specialize=["num_chunks"])  # per-step sizes: no recompiles mid-run
def _fused_plan_kernel(
    logits_ptr,
    logits_stride,
    idx_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    part_max_ptr,
    part_sum_ptr,
    group_max_ptr,
    row_max_ptr,
    row_sum_ptr,
    cutoff_ptr,
    count_ptr,
    chosen_ptr,
    cand_value_ptr,
    cand_token_ptr,
    num_groups,
    num_chunks,
    vocab_size,
    SANITIZE: tl.constexpr,
    CAP: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNKS: tl.constexpr,
    GROUPS: tl.constexpr,
):
    logits_row = tl.program_id(0).to(tl.int64)
    req_slot, temp, k_on, p_on, gather = _row_filters(idx_ptr, temp_ptr, top_k_ptr, top_p_ptr, logits_row, vocab_size)
    chunks = tl.arange(0, CHUNKS)
    part_max = tl.load(part_max_ptr + logits_row * num_chunks + chunks, mask=chunks < num_chunks, other=-float("inf"))
    part_sum = tl.load(part_sum_ptr + logits_row * num_chunks + chunks, mask=chunks < num_chunks, other=0.0)
    x_max = tl.max(part_max, axis=0)
    row_max = tl.math.div_rn(x_max, temp)  # of y
    finite = part_max > -float("inf")
    part_scale = tl.exp(tl.math.div_rn(tl.where(finite, part_max, 0.0), temp) - tl.where(finite, row_max, 0.0))
    tl.store(row_max_ptr + logits_row, row_max)  # read by min-p in the sample kernel
    if gather:
        tl.store(row_sum_ptr + logits_row, tl.sum(tl.where(finite, part_sum * part_scale, 0.0), axis=0))
        _plan_row(
            logits_ptr + logits_row * logits_stride,
            logits_row,
            req_slot,
            k_on,
            top_k_ptr,
            group_max_ptr,
            cutoff_ptr,
            count_ptr,
            chosen_ptr,
            cand_value_ptr,
            cand_token_ptr,
            num_groups,
            vocab_size,
            SANITIZE,
            CAP,
            GROUP,
            GROUPS,
        )


@triton.jit
def _plan_row(
    row_ptr,
    logits_row,
    req_slot,
    k_on,
    top_k_ptr,
    group_max_ptr,
    cutoff_ptr,
    count_ptr,
    chosen_ptr,
    cand_value_ptr,
    cand_token_ptr,
    num_groups,
    vocab_size,
    SANITIZE: tl.constexpr,
    CAP: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """Steps 1-3 of the plan for one gather row: its cutoff (in `cutoff_ptr`) and its candidates (their number
    in `count_ptr`, more than CAP when they overflowed)."""
    MAX_GROUPS: tl.constexpr = CAP // GROUP  # groups whose tokens surely fit the buffer; groups per gather tile
    # 1. A cutoff c (on x) with want <= groups(max >= c) <= limit: then c <= t_k (want tokens are >= c) and at
    # most GROUP * limit tokens are >= c. Top-k wants k; top-p alone wants as many as fit.
    top_k = tl.load(top_k_ptr + req_slot)
    fits = tl.zeros([], dtype=tl.int32) + MAX_GROUPS
    limit = tl.where(k_on, tl.maximum(top_k, tl.minimum(2 * top_k, fits)), fits)
    want = tl.where(k_on, top_k, tl.maximum(fits // 2, 1))
    groups = tl.arange(0, GROUPS)
    valid = groups < num_groups
    # Lanes past the row hold -inf: no larger than any group max, as the cutoff searches require.
    group_max = tl.load(group_max_ptr + logits_row * num_groups + groups, mask=valid, other=-float("inf"))
    keys = _ordered_key(group_max)
    cutoff = tl.full([], -float("inf"), tl.float32)
    if want <= num_groups:
        key, unused_count = _bisect_cutoff(keys, valid, num_groups, want, limit)
        cutoff = _key_value(key)
        # x / T may round a slightly smaller x to the same y as c: lower c by more than that (4 ulp).
        cutoff = tl.where(cutoff > -float("inf"), cutoff - tl.abs(cutoff) * (1.0 / 1048576.0) - 1e-30, cutoff)
    tl.store(cutoff_ptr + logits_row, cutoff)
    # 2. The ids of the groups whose max is >= c, compacted (scratch of CAP per row: a chosen group holds at
    # least one candidate, so more than CAP of them overflow the buffer anyway).
    chosen = valid & (group_max >= cutoff) & (group_max > -float("inf"))
    num_chosen = tl.sum(chosen.to(tl.int32), axis=0)
    pos = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(chosen_ptr + logits_row * CAP + pos, groups, mask=chosen & (pos < CAP))
    tl.debug_barrier()  # the list is read back by other threads of this program
    # 3. Their tokens, MAX_GROUPS groups per tile (one tile for k <= MAX_GROUPS): append every finite x >= c
    # (x, id) to the row's buffer; the count goes on past CAP, which sends the row to the exact path.
    n = tl.zeros([], dtype=tl.int32)
    if num_chosen > CAP:
        n += CAP + 1
    else:
        for t0 in range(0, num_chosen, MAX_GROUPS):
            tile = t0 + tl.arange(0, MAX_GROUPS)
            in_tile = tile < num_chosen
            group = tl.load(chosen_ptr + logits_row * CAP + tile, mask=in_tile, other=0)
            offs = tl.reshape(group[:, None] * GROUP + tl.arange(0, GROUP)[None, :], [CAP])
            mask = tl.reshape(tl.broadcast_to(in_tile[:, None], [MAX_GROUPS, GROUP]), [CAP]) & (offs < vocab_size)
            x, unused_bad = _load_x(row_ptr, offs, mask, SANITIZE)
            take = mask & (x >= cutoff) & (x > -float("inf"))
            slot = n + tl.cumsum(take.to(tl.int32), axis=0) - 1
            store = take & (slot < CAP)
            tl.store(cand_value_ptr + logits_row * CAP + slot, x, mask=store)
            tl.store(cand_token_ptr + logits_row * CAP + slot, offs, mask=store)
            n += tl.sum(take.to(tl.int32), axis=0)
    tl.store(count_ptr + logits_row, n)


@triton.jit(do_not_specialize=["num_chunks", "chunk_size"])  # per-step sizes: no recompiles mid-run
def _fused_sample_kernel(
    logits_ptr,
    logits_stride,
    idx_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    positions_ptr,
    row_max_ptr,
    part_best_ptr,
    part_token_ptr,
    part_bad_ptr,
    num_chunks,
    chunk_size,
    vocab_size,
    SANITIZE: tl.constexpr,
    HAS_PLAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    logits_row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    req_slot, temp, _, _, gather = _row_filters(idx_ptr, temp_ptr, top_k_ptr, top_p_ptr, logits_row, vocab_size)
    row_ptr = logits_ptr + logits_row * logits_stride
    start0 = chunk * chunk_size
    end = tl.minimum(start0 + chunk_size, vocab_size)
    if gather == 0:  # gather rows were sampled from their candidates, gathered by the plan
        greedy = tl.load(temp_ptr + req_slot) == 0.0
        min_p = tl.load(min_p_ptr + req_slot)
        use_min_p = (min_p > 0.0) & (greedy == 0)
        lane_bad = tl.zeros([BLOCK], dtype=tl.int32)
        # Per lane best (score, token) over the blocks; one reduction at the end of the chunk instead of two
        # per block. A lane keeps its first token on a tie (strict >), and the lowest tied token id wins the
        # final reduction: the lowest token id of the chunk's maximum, like torch.argmax.
        lane_value = tl.full([BLOCK], -float("inf"), tl.float32)
        lane_token = tl.zeros([BLOCK], dtype=tl.int32)
        row_max = 0.0
        if HAS_PLAN:
            row_max = tl.load(row_max_ptr + logits_row)
        key = _row_key(tl.load(seed_ptr + req_slot), tl.load(positions_ptr + logits_row))
        for start in range(start0, end, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < vocab_size
            x, block_bad = _load_x(row_ptr, offs, mask, SANITIZE)
            lane_bad += block_bad
            if greedy:
                score = x
            else:
                y = tl.math.div_rn(x, temp)  # IEEE division, as torch
                score = y + _gumbel_noise(key, offs)
                if use_min_p:
                    score = tl.where(tl.exp(y - row_max) < min_p, -float("inf"), score)
            take = mask & (score > lane_value)
            lane_token = tl.where(take, offs, lane_token)
            lane_value = tl.where(take, score, lane_value)
        best_value = tl.max(lane_value, axis=0)
        best_token = tl.min(tl.where(lane_value == best_value, lane_token, 2147483647), axis=0)
        tl.store(part_best_ptr + logits_row * num_chunks + chunk, best_value)
        tl.store(part_token_ptr + logits_row * num_chunks + chunk, best_token)
        tl.store(part_bad_ptr + logits_row * num_chunks + chunk, tl.sum(lane_bad, axis=0))


def sample_fused_triton(
    logits: torch.Tensor,  # [L, V] float32 or the model dtype (bf16/fp16: widened in registers), read only
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    positions: torch.Tensor,  # [L] int64: position of the token being sampled
    params: SlotSamplingParams,
    *,
    sanitize: bool = True,
    nonfinite: Optional[torch.Tensor] = None,  # [L] bool from an earlier `sanitize_logits` (when not sanitize)
    need_plan: bool = True,
    all_gather: bool = False,
    nonfinite_code: int = 1,
    no_token_code: int = 2,
) -> FusedSample:
    """Same result as `samplers.reference.sample_reference`.

    `sanitize`: treat NaN/+inf as -inf and flag the row (the caller did not run `sanitize_logits`).
    `need_plan=False` skips pass 1 and the plan; only valid when no row uses top-k, top-p or min-p.
    `all_gather=True` skips the sample kernel; only valid when every row is a gather row (random, with top-k
    or top-p). The host mirrors tell both, see `SamplingStages`.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    sampled = torch.empty(num_rows, dtype=torch.int64, device=device)
    errors = torch.empty(num_rows, dtype=torch.int32, device=device)
    if num_rows == 0:
        return FusedSample(sampled, errors)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    block = vocab_block(vocab_size)
    num_blocks = cdiv(vocab_size, block)
    blocks_per_chunk = cdiv(num_blocks, max(1, min(num_blocks, cdiv(TARGET_PROGRAMS, num_rows))))
    chunk_size = blocks_per_chunk * block
    num_chunks = cdiv(vocab_size, chunk_size)
    # Constexpr sizes depend on the vocabulary only, never on the batch: one compiled variant serves every step.
    max_chunks = next_power_of_2(num_blocks)
    group = _group_size(vocab_size)
    num_groups = cdiv(vocab_size, group)
    if need_plan and CAP % group:
        raise ValueError(f"GROUP = {GROUP} must divide CAP = {CAP} (both powers of two)")
    if all_gather and not need_plan:
        raise ValueError("all_gather=True needs the plan (need_plan=True): gather rows are sampled from it")
    ws = _Workspace(num_rows, num_chunks, num_groups, device)
    flags = nonfinite if nonfinite is not None else ws.part_bad  # any pointer: unread without HAS_FLAGS
    tables = (params.temperature, params.top_k, params.top_p)
    grid = (num_rows, num_chunks)
    if need_plan:
        _fused_stats_kernel[grid](
            logits,
            logits.stride(0),
            expanded_idx_mapping,
            *tables,
            ws.part_max,
            ws.part_sum,
            ws.part_bad,
            ws.group_max,
            num_groups,
            num_chunks,
            chunk_size,
            vocab_size,
            SANITIZE=sanitize,
            BLOCK=block,
            GROUP=group,
            num_warps=STATS_WARPS,
        )
        _launch_plan(logits, expanded_idx_mapping, params, ws, num_chunks, max_chunks, sanitize=sanitize)
    if not all_gather:
        _fused_sample_kernel[grid](
            logits,
            logits.stride(0),
            expanded_idx_mapping,
            *tables,
            params.min_p,
            params.seed,
            positions,
            ws.row_max,
            ws.part_best,
            ws.part_token,
            ws.part_bad,
            num_chunks,
            chunk_size,
            vocab_size,
            SANITIZE=sanitize,
            HAS_PLAN=need_plan,
            BLOCK=block,
            num_warps=SAMPLE_WARPS,
        )
    _fused_resolve_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        expanded_idx_mapping,
        *tables,
        params.min_p,
        params.seed,
        positions,
        ws.count,
        ws.row_max,
        ws.row_sum,
        ws.cutoff,
        ws.cand_value,
        ws.cand_token,
        ws.part_best,
        ws.part_token,
        ws.part_bad,
        flags,
        sampled,
        errors,
        num_chunks,
        vocab_size,
        SANITIZE=sanitize,
        HAS_FLAGS=nonfinite is not None,
        NONFINITE_CODE=nonfinite_code,
        NO_TOKEN_CODE=no_token_code,
        CHUNKS=max_chunks,
        BLOCK=block,
        CAP=CAP,
        TILE_I=RESOLVE_TILE,
        TILE_J=RESOLVE_TILE,
        num_warps=RESOLVE_WARPS,
    )
    return FusedSample(sampled, errors)


def sample_fused(
    logits: torch.Tensor,  # [L, V] float32 or the model dtype (NaN/+inf allowed: treated as -inf and flagged)
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    positions: torch.Tensor,  # [L] int64
    params: SlotSamplingParams,
    *,
    fused: Optional[bool] = None,
    any_random: bool = True,
    need_plan: bool = True,
    all_gather: bool = False,
    nonfinite_code: int = 1,
    no_token_code: int = 2,
) -> FusedSample:
    """Steps 1 and 8-12 on raw logits (all the V1 runner samples): the fused Triton path (`fused=None`: on CUDA
    tensors), else the reference. The host's hints: `need_plan` / `all_gather` as for `sample_fused_triton`,
    `any_random=False` when every row is greedy (the reference then takes the argmax alone)."""
    if use_triton(logits) if fused is None else fused:
        return sample_fused_triton(
            logits,
            expanded_idx_mapping,
            positions,
            params,
            need_plan=need_plan,
            all_gather=all_gather,
            nonfinite_code=nonfinite_code,
            no_token_code=no_token_code,
        )
    return sample_reference(
        logits,
        expanded_idx_mapping,
        positions,
        params,
        nonfinite_code,
        no_token_code,
        any_random=any_random,
        any_filter=need_plan,
    )


def _group_size(vocab_size: int) -> int:
    """Tokens per group maximum: GROUP, or the whole vocabulary block of a tiny vocabulary (a group lies in
    one block of the first pass)."""
    return min(GROUP, vocab_block(vocab_size))


def _launch_plan(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    params: SlotSamplingParams,
    ws: "_Workspace",
    num_chunks: int,
    max_chunks: int,
    *,
    sanitize: bool,
) -> None:
    """`_fused_plan_kernel` over every row, configured by the module's GROUP / CAP / PLAN_* constants (the
    stats kernel must have written `ws` with the same group size, `_group_size`)."""
    vocab_size = logits.shape[1]
    group = _group_size(vocab_size)
    num_groups = cdiv(vocab_size, group)
    # (a compiler option: the interpreter takes none)
    options = {} if PLAN_MAXNREG is None or not logits.is_cuda else dict(maxnreg=PLAN_MAXNREG)
    _fused_plan_kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        expanded_idx_mapping,
        params.temperature,
        params.top_k,
        params.top_p,
        ws.part_max,
        ws.part_sum,
        ws.group_max,
        ws.row_max,
        ws.row_sum,
        ws.cutoff,
        ws.count,
        ws.chosen,
        ws.cand_value,
        ws.cand_token,
        num_groups,
        num_chunks,
        vocab_size,
        SANITIZE=sanitize,
        CAP=CAP,
        GROUP=group,
        CHUNKS=max_chunks,
        GROUPS=next_power_of_2(num_groups),
        num_warps=PLAN_WARPS,
        **options,
    )


class _Workspace:
    """Scratch of one call, carved from one float32 and one int32 allocation (fewer allocator calls)."""

    def __init__(self, num_rows: int, num_chunks: int, num_groups: int, device: torch.device) -> None:
        rows, chunks = num_rows, num_rows * num_chunks
        f = _carve(torch.float32, [rows, rows * CAP, chunks, chunks, chunks, rows * num_groups, rows, rows], device)
        i = _carve(torch.int32, [rows, rows * CAP, chunks, chunks, rows * CAP], device)
        self.row_max = f[0]  # [L] max of y
        self.row_sum, self.cutoff = f[6], f[7]  # [L] sum of exp(y - max y); [L] the plan's cutoff on x
        self.cand_value = f[1]  # [L, CAP] candidate x
        self.part_max, self.part_sum, self.part_best = f[2], f[3], f[4]  # [L, C] per chunk
        self.group_max = f[5]  # [L, num_groups] x max of each group
        # [L] candidates gathered (more than CAP: overflowed), [L, CAP] their token ids
        self.count, self.cand_token = i[0], i[1]
        self.part_token, self.part_bad = i[2], i[3]  # [L, C] per chunk
        self.chosen = i[4]  # [L, CAP] ids of the groups the plan gathers


def _carve(dtype: torch.dtype, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    """Tensors of `sizes` elements from one allocation, each starting 16-byte aligned whatever the sizes: Triton
    specialises pointers on 16-byte alignment, so unaligned parts would compile new kernel variants per batch."""
    per_16 = 16 // dtype.itemsize
    padded = [-(-n // per_16) * per_16 for n in sizes]
    flat = torch.empty(sum(padded), dtype=dtype, device=device)
    return [part[:n] for part, n in zip(flat.split(padded), sizes)]
