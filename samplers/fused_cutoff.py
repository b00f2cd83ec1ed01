"""How the fused plan (`samplers.fused_sampling._fused_plan_kernel`) picks its cutoff over a row's group maxima.

`_bisect_cutoff` takes the order-preserving int32 keys (`samplers.top_k_top_p._ordered_key`) of one row's group
maxima, held in registers as one block of lanes (`valid` marks the row's `num_groups`), and returns
`(key c, G(c))`, `G(c)` being the number of valid keys `>= c`, such that

    want <= G(c) <= limit      (the upper bound may fail only when ties at c forbid it: G(c+1) < want)

by bisection over the key range, one reduction per round (about 12-15 rounds on logits). Lanes outside `valid`
must hold a key no larger than the smallest valid key (the plan loads them as -inf).

A radix select (`tl.histogram`) and 4-way / value-guided splits were measured against it on an H200 and lost
or tied (docs/benchmarks.md, "Third design"); they are gone.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _key_value(key):
    """The float32 whose `_ordered_key` is `key` (the inverse; key 0 is +0.0)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


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
