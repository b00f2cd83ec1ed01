"""Top-k, top-p (nucleus) and min-p masking: excluded tokens get -inf.

Semantics, shared exactly by the references and the Triton kernels (ties included):

- **top-k** (k in 1..V-1; k <= 0 or k >= V is off): let `t_k` be the k-th largest logit of the row, counting
  repeated values; keep every token with `logit >= t_k`. Tokens tied with the k-th are all kept, so more
  than k tokens survive only on an exact tie.
- **top-p** (p in (0, 1); p >= 1 is off), on the distribution left by top-k: with `e_j = exp(l_j - max)`
  summed to `Z` over the top-k survivors, token t is kept iff the mass of strictly more likely tokens
  `sum(e_j for l_j > l_t)` is `< p * Z`. The most likely token is always kept, tied tokens are kept or
  dropped together, and the kept set is the smallest top set whose mass reaches p. The masses are float32
  sums, so the two implementations can disagree only when the mass before a token is within float rounding
  (~1e-6 relative) of `p * Z`.
- **min-p** (0 is off), applied after top-k/top-p: keep token t iff `exp(l_t - max) >= min_p`, i.e. its
  probability is at least min_p times the most likely token's.

A row whose logits are all -inf is left as it is. -0.0 and +0.0 are the same value. NaN must not occur
(the sampler replaces it before these stages).

The Triton top-k/top-p kernel needs no sort: it finds each threshold by bisection over the order-preserving
integer image of float32 (33 counting passes per threshold), one program per logits row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samplers.triton_utils import use_triton, vocab_block


def apply_top_k_top_p_reference(
    logits: torch.Tensor,  # [L, V] float32, temperature-scaled
    top_k: torch.Tensor,  # [L] int32, <= 0 or >= V = disabled
    top_p: torch.Tensor,  # [L] float32, >= 1.0 = disabled
) -> torch.Tensor:
    """[L, V]: keep tokens at or above the top-k threshold, then at or above the top-p threshold."""
    vocab = logits.shape[1]
    sorted_desc = logits.sort(dim=-1, descending=True).values  # [L, V]
    k_on = ((top_k > 0) & (top_k < vocab)).unsqueeze(1)  # [L, 1]
    kth = sorted_desc.gather(1, (top_k.long().clamp(1, vocab) - 1).unsqueeze(1))  # [L, 1] k-th largest
    threshold = torch.where(k_on, kth, torch.full_like(kth, float("-inf")))

    row_max = sorted_desc[:, :1]
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(sorted_desc - safe_max) * (sorted_desc >= threshold)  # [L, V] e_j of top-k survivors
    total = weights.sum(dim=-1, keepdim=True)  # Z
    cum = weights.cumsum(dim=-1)
    # Mass of strictly larger logits: the cumulative sum just before the first token of each tie group.
    neg = -sorted_desc  # ascending
    first_of_tie = torch.searchsorted(neg.contiguous(), neg.contiguous(), side="left")  # [L, V]
    mass_gt = torch.where(first_of_tie > 0, cum.gather(1, (first_of_tie - 1).clamp(min=0)), torch.zeros_like(cum))
    kept_sorted = mass_gt < top_p.unsqueeze(1) * total  # a prefix of the sorted row
    num_kept = kept_sorted.sum(dim=-1, keepdim=True).clamp(min=1)
    p_threshold = sorted_desc.gather(1, num_kept - 1)
    p_on = (top_p < 1.0).unsqueeze(1) & torch.isfinite(row_max)
    threshold = torch.where(p_on, torch.maximum(threshold, p_threshold), threshold)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_min_p_reference(
    logits: torch.Tensor,  # [L, V] float32
    min_p: torch.Tensor,  # [L] float32, 0 = disabled
) -> torch.Tensor:
    """[L, V]: drop tokens whose probability is below min_p times the most likely token's."""
    row_max = logits.amax(dim=-1, keepdim=True)
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    ratio = torch.exp(logits - safe_max)  # p_t / p_max
    return logits.masked_fill(ratio < min_p.unsqueeze(1), float("-inf"))


# ---- Triton ------------------------------------------------------------------------------------------------


@triton.jit
def _ordered_key(x):
    """int32 with the order of float32 `x` (no NaN); -0.0 and +0.0 map to the same key (0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(x == 0.0, 0, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits))


@triton.jit
def _load_scaled(row_ptr, offs, vocab_size, temp, SANITIZE: tl.constexpr):
    """y = x / temp of one block of a row (-inf past its end; NaN and +inf become -inf under SANITIZE), in
    float32 (the fused sampler's slow path may read bf16/fp16 logits: widened exactly)."""
    x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=-float("inf")).to(tl.float32)
    if SANITIZE:
        x = tl.where(x < float("inf"), x, -float("inf"))
    return tl.math.div_rn(x, temp)  # IEEE division, as torch (exact for temp = 1)


@triton.jit
def _top_k_top_p_threshold(row_ptr, temp, k_on, k, p_on, p, vocab_size, SANITIZE: tl.constexpr, BLOCK: tl.constexpr):
    """(int64 key threshold, row max of y) of one row of y = x / temp: top-k then top-p keep exactly the tokens
    whose `_ordered_key(y)` is >= the threshold. No sort: each threshold is a bisection over the keys, 33
    counting passes over the row. Shared by `_top_k_top_p_kernel` (temp = 1) and the fused sampler's slow path."""
    # Pass 1: row max and the range of keys.
    row_max = tl.full([], -float("inf"), tl.float32)
    key_min = tl.full([], 2147483647, tl.int32)
    key_max = tl.full([], -2147483648, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab_size
        y = _load_scaled(row_ptr, offs, vocab_size, temp, SANITIZE)
        keys = _ordered_key(y)
        row_max = tl.maximum(row_max, tl.max(y, axis=0))
        key_min = tl.minimum(key_min, tl.min(tl.where(mask, keys, 2147483647), axis=0))
        key_max = tl.maximum(key_max, tl.max(tl.where(mask, keys, -2147483648), axis=0))
    threshold = key_min.to(tl.int64)
    if row_max > -float("inf"):
        # top-k: the largest key v with count(keys >= v) >= k (invariant: cond(lo), not cond(hi)).
        if k_on:
            lo = key_min.to(tl.int64)
            hi = key_max.to(tl.int64) + 1
            for _ in range(33):
                mid = lo + (hi - lo) // 2
                count = tl.zeros([], dtype=tl.int32)
                for start in range(0, vocab_size, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    keys = _ordered_key(_load_scaled(row_ptr, offs, vocab_size, temp, SANITIZE)).to(tl.int64)
                    count += tl.sum(((offs < vocab_size) & (keys >= mid)).to(tl.int32), axis=0)
                take = count >= k
                lo = tl.where(take, mid, lo)
                hi = tl.where(take, hi, mid)
            threshold = lo
        # top-p: the smallest key v with mass(keys > v) < p * Z (invariant: not cond(lo), cond(hi)).
        if p_on:
            total = tl.zeros([], dtype=tl.float32)
            for start in range(0, vocab_size, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                y = _load_scaled(row_ptr, offs, vocab_size, temp, SANITIZE)
                keep = (offs < vocab_size) & (_ordered_key(y).to(tl.int64) >= threshold)
                total += tl.sum(tl.where(keep, tl.exp(y - row_max), 0.0), axis=0)
            target = p * total
            lo = threshold - 1
            hi = key_max.to(tl.int64)
            for _ in range(33):
                mid = lo + (hi - lo) // 2
                mass = tl.zeros([], dtype=tl.float32)
                for start in range(0, vocab_size, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    y = _load_scaled(row_ptr, offs, vocab_size, temp, SANITIZE)
                    above = (offs < vocab_size) & (_ordered_key(y).to(tl.int64) > mid)
                    mass += tl.sum(tl.where(above, tl.exp(y - row_max), 0.0), axis=0)
                take = mass < target
                hi = tl.where(take, mid, hi)
                lo = tl.where(take, lo, mid)
            threshold = tl.maximum(threshold, hi)
    return threshold, row_max


@triton.jit
def _top_k_top_p_kernel(logits_ptr, logits_stride, top_k_ptr, top_p_ptr, vocab_size, BLOCK: tl.constexpr):
    logits_row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + logits_row * logits_stride
    k = tl.load(top_k_ptr + logits_row)
    p = tl.load(top_p_ptr + logits_row)
    k_on = (k > 0) & (k < vocab_size)
    p_on = p < 1.0
    if k_on | p_on:
        one = tl.full([], 1.0, tl.float32)
        threshold, row_max = _top_k_top_p_threshold(row_ptr, one, k_on, k, p_on, p, vocab_size, False, BLOCK)
        if row_max > -float("inf"):
            for start in range(0, vocab_size, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < vocab_size
                x = tl.load(row_ptr + offs, mask=mask, other=-float("inf"))
                x = tl.where(_ordered_key(x).to(tl.int64) >= threshold, x, -float("inf"))
                tl.store(row_ptr + offs, x, mask=mask)


def apply_top_k_top_p_triton(
    logits: torch.Tensor,  # [L, V] float32, written in place
    top_k: torch.Tensor,  # [L] int32
    top_p: torch.Tensor,  # [L] float32
) -> torch.Tensor:
    """In place, same result as `apply_top_k_top_p_reference`; returns `logits`."""
    num_rows, vocab_size = logits.shape
    if num_rows:
        assert logits.stride(1) == 1
        _top_k_top_p_kernel[(num_rows,)](
            logits,
            logits.stride(0),
            top_k.int().contiguous(),
            top_p.float().contiguous(),
            vocab_size,
            BLOCK=vocab_block(vocab_size),
        )
    return logits


@triton.jit
def _min_p_kernel(logits_ptr, logits_stride, min_p_ptr, vocab_size, BLOCK: tl.constexpr):
    logits_row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + logits_row * logits_stride
    min_p = tl.load(min_p_ptr + logits_row)
    if min_p > 0.0:
        row_max = tl.full([], -float("inf"), tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=-float("inf"))
            row_max = tl.maximum(row_max, tl.max(x, axis=0))
        if row_max > -float("inf"):
            for start in range(0, vocab_size, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < vocab_size
                x = tl.load(row_ptr + offs, mask=mask, other=-float("inf"))
                x = tl.where(tl.exp(x - row_max) < min_p, -float("inf"), x)
                tl.store(row_ptr + offs, x, mask=mask)


def apply_min_p_triton(
    logits: torch.Tensor,  # [L, V] float32, written in place
    min_p: torch.Tensor,  # [L] float32
) -> torch.Tensor:
    """In place, same result as `apply_min_p_reference`; returns `logits`."""
    num_rows, vocab_size = logits.shape
    if num_rows:
        assert logits.stride(1) == 1
        _min_p_kernel[(num_rows,)](
            logits, logits.stride(0), min_p.float().contiguous(), vocab_size, BLOCK=vocab_block(vocab_size)
        )
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[L, V] masked logits (Triton on CUDA, writing in place; the reference elsewhere)."""
    if use_triton(logits):
        return apply_top_k_top_p_triton(logits, top_k, top_p)
    return apply_top_k_top_p_reference(logits, top_k, top_p)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[L, V] masked logits (Triton on CUDA, writing in place; the reference elsewhere)."""
    if use_triton(logits):
        return apply_min_p_triton(logits, min_p)
    return apply_min_p_reference(logits, min_p)
