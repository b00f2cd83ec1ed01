"""How the fused plan (`samplers.fused_sampling._fused_plan_kernel`) picks its cutoff over a row's group maxima.

Every function here takes the order-preserving int32 keys (`samplers.top_k_top_p._ordered_key`) of one row's
group maxima, held in registers as one block of `GROUPS` lanes (`valid` marks the row's `num_groups`), and
returns `(key c, G(c))`, `G(c)` being the number of valid keys `>= c`, such that

    want <= G(c) <= limit      (the upper bound may fail only when ties at c forbid it: G(c+1) < want)

Lanes outside `valid` must hold a key no larger than the smallest valid key (the plan loads them as -inf): the
loops only count thresholds above the smallest valid key, so those lanes never count and need no mask.

- `_bisect_cutoff`: bisection over the key range, one reduction per round (about 12-15 rounds on logits).
- `_split_cutoff`: a 4-way split per round: three thresholds counted by one reduction (16-bit counts packed in
  an int64), about half the rounds. With `GUESS_ROUNDS`, the first rounds put the thresholds at the quarter
  points of the *values* between the bounds (logits spread evenly in value, not in key; the window of cutoffs
  with `want <= G <= limit` is wide in value): about 3-4 rounds on logits. Later rounds split the key range,
  so the worst case stays about 16 rounds past the guesses.
- `_radix_cutoff`: a radix select with `tl.histogram`, at most 4 rounds, but the histogram contends on the few
  busy bins of clustered keys (slower than bisection on an H200).

`_cutoff` dispatches on the `CUTOFF` constexpr (`CUTOFFS` maps names to its values).
"""

from __future__ import annotations

import triton
import triton.language as tl

from samplers.top_k_top_p import _ordered_key

CUTOFFS = {"bisect": 0, "radix": 1, "split": 2, "guess": 3}  # values of the `CUTOFF` constexpr
GUESS_ROUNDS = tl.constexpr(4)  # rounds of value-space thresholds of "guess" before key-space ones (a constexpr:
# read by kernels)
MAX_SPLIT_GROUPS = 65535  # the split packs counts of up to this many groups in 16 bits


@triton.jit
def _key_value(key):
    """The float32 whose `_ordered_key` is `key` (the inverse; key 0 is +0.0)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _radix_cutoff(keys, valid, num_groups, want, limit, GROUPS: tl.constexpr):
    """A radix select over the 4 bytes of the unsigned image of the keys, most significant first: each round
    histograms the next byte of the keys whose higher bytes equal c's, and takes the largest byte value that
    keeps `want` keys at or above c. It stops as soon as the count is at most `limit` (often after 2 rounds).
    """
    bins = tl.arange(0, 256)
    ukeys = keys ^ -2147483648  # flips the sign bit: the signed order becomes the unsigned order of the bits
    prefix = tl.zeros([], dtype=tl.int32)  # the bytes of c chosen so far (the rest 0)
    fixed = tl.zeros([], dtype=tl.int32)  # mask of those bytes
    above = tl.zeros([], dtype=tl.int32)  # keys whose fixed bytes exceed prefix's
    count = tl.zeros([], dtype=tl.int32) + num_groups  # keys >= prefix
    for r in tl.static_range(4):
        if count > limit:
            shift: tl.constexpr = 24 - 8 * r
            match = valid & ((ukeys & fixed) == prefix)
            digit = tl.where(match, (ukeys >> shift) & 255, 0)
            num_other = GROUPS - tl.sum(match.to(tl.int32), axis=0)  # counted in bin 0 by the histogram
            hist = tl.histogram(digit, 256) - tl.where(bins == 0, num_other, 0)
            at_or_above = above + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys >= byte b
            byte = tl.max(tl.where(at_or_above >= want, bins, 0), axis=0)  # bin 0 always qualifies
            count = tl.sum(tl.where(bins == byte, at_or_above, 0), axis=0)
            above = count - tl.sum(tl.where(bins == byte, hist, 0), axis=0)
            prefix = prefix | (byte << shift)
            fixed = fixed | (tl.full([], -1, tl.int32) << shift)
    key = (prefix ^ -2147483648)
    # The byte-aligned key may lie below every key (even below -inf's: a NaN pattern): raise it to the smallest
    # key, which has the same count.
    return tl.maximum(key, tl.min(tl.where(valid, keys, 2147483647), axis=0)), count


@triton.jit
def _bisect_cutoff(keys, valid, num_groups, want, limit):
    """Bisection over the key range. Invariant: G(lo) >= want > G(hi)."""
    lo = tl.min(tl.where(valid, keys, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(tl.where(valid, keys, -2147483648), axis=0).to(tl.int64) + 1
    count_lo = tl.zeros([], dtype=tl.int32) + num_groups
    while (hi - lo > 1) & (count_lo > limit):
        mid = lo + (hi - lo) // 2  # < hi <= 2**31: fits int32, so the keys stay int32 (registers)
        count = tl.sum((valid & (keys >= mid.to(tl.int32))).to(tl.int32), axis=0)
        take = count >= want
        lo = tl.where(take, mid, lo)
        count_lo = tl.where(take, count, count_lo)
        hi = tl.where(take, hi, mid)
    return lo.to(tl.int32), count_lo


@triton.jit
def _split_cutoff(keys, valid, num_groups, want, limit, top_key, GUESS_ROUNDS: tl.constexpr):
    """Three thresholds m1 <= m2 <= m3 strictly inside (lo, hi) per round, counted in one reduction; the
    interval shrinks to the quarter holding the answer. Invariant: G(lo) >= want > G(hi). `top_key`: the
    largest valid key (the caller knows the row max; a smaller value only costs rounds). Needs
    num_groups <= MAX_SPLIT_GROUPS."""
    lo = tl.min(tl.where(valid, keys, 2147483647), axis=0).to(tl.int64)
    hi = top_key.to(tl.int64) + 1
    count_lo = tl.zeros([], dtype=tl.int32) + num_groups
    rounds = tl.zeros([], dtype=tl.int32)
    while (hi - lo > 1) & (count_lo > limit):
        d = hi - lo
        m1 = lo + d // 4
        m2 = lo + d // 2
        m3 = lo + (3 * d) // 4
        if GUESS_ROUNDS > 0:
            lo_value = _key_value(lo.to(tl.int32))
            half = 0.5 * _key_value((hi - 1).to(tl.int32)) - 0.5 * lo_value  # (halves: no overflow)
            if (rounds < GUESS_ROUNDS) & (half > 0.0) & (half < float("inf")):  # (-inf bounds: key quarters)
                m1 = _ordered_key(lo_value + 0.5 * half).to(tl.int64)
                m2 = _ordered_key(lo_value + half).to(tl.int64)
                m3 = _ordered_key(lo_value + 1.5 * half).to(tl.int64)
        # Strictly inside: the interval shrinks every round, and thresholds above lo never count the lanes
        # outside `valid` (they hold at most the smallest valid key).
        m1 = tl.minimum(tl.maximum(m1, lo + 1), hi - 1)
        m2 = tl.minimum(tl.maximum(m2, m1), hi - 1)
        m3 = tl.minimum(tl.maximum(m3, m2), hi - 1)
        packed = (keys >= m1.to(tl.int32)).to(tl.int64) + ((keys >= m2.to(tl.int32)).to(tl.int64) << 16) \
            + ((keys >= m3.to(tl.int32)).to(tl.int64) << 32)
        total = tl.sum(packed, axis=0)
        c1 = (total & 65535).to(tl.int32)
        c2 = ((total >> 16) & 65535).to(tl.int32)
        c3 = (total >> 32).to(tl.int32)
        # c1 >= c2 >= c3: take the highest threshold that keeps `want`; the next one up is the new hi.
        hi = tl.where(c3 >= want, hi, tl.where(c2 >= want, m3, tl.where(c1 >= want, m2, m1)))
        new_lo = tl.where(c3 >= want, m3, tl.where(c2 >= want, m2, tl.where(c1 >= want, m1, lo)))
        count_lo = tl.where(c3 >= want, c3, tl.where(c2 >= want, c2, tl.where(c1 >= want, c1, count_lo)))
        lo = new_lo
        rounds += 1
    return lo.to(tl.int32), count_lo


@triton.jit
def _cutoff(keys, valid, num_groups, want, limit, top_key, GROUPS: tl.constexpr, CUTOFF: tl.constexpr):
    """(key c, G(c)) by the search `CUTOFF` names (see `CUTOFFS`)."""
    if CUTOFF == 1:
        key, count = _radix_cutoff(keys, valid, num_groups, want, limit, GROUPS)
    elif CUTOFF == 2:
        key, count = _split_cutoff(keys, valid, num_groups, want, limit, top_key, 0)
    elif CUTOFF == 3:
        key, count = _split_cutoff(keys, valid, num_groups, want, limit, top_key, GUESS_ROUNDS)
    else:
        key, count = _bisect_cutoff(keys, valid, num_groups, want, limit)
    return key, count


def cutoff_code(name: str, num_groups: int) -> int:
    """The `CUTOFF` constexpr for `name`; the split searches fall back to bisection past MAX_SPLIT_GROUPS."""
    if name not in CUTOFFS:
        raise ValueError(f"unknown plan cutoff {name!r}: expected one of {sorted(CUTOFFS)}")
    if CUTOFFS[name] >= 2 and num_groups > MAX_SPLIT_GROUPS:
        return CUTOFFS["bisect"]
    return CUTOFFS[name]
