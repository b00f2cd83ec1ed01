"""Integer arithmetic of launch shapes on the host: `cdiv` and `next_power_of_2`, as plain Python.

Triton's own (`triton.cdiv`, `triton.next_power_of_2`) are constexpr functions in current Triton (3.9 here;
usable inside kernels): a call from the host first unwraps its arguments, ~5 us on the development CPU at its
half-speed probe against ~0.07 us for the arithmetic itself (not measured on the GPU machine's Triton 3.6), and
an eager prefill step makes hundreds of them (the q/k norm + RoPE wrapper alone made six a call). Same results
as Triton's, 0 and negative sizes included.
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """Ceiling of x / y for y > 0 (Triton's `cdiv`)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1; 0 for n <= 0 (as Triton's `next_power_of_2`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
