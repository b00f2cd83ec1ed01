"""`framework.layers.kernels.launch_math` against Triton's own `cdiv` / `next_power_of_2`, and no host code calling
Triton's (constexpr functions, ~5 us a host call on a slow host: see the module)."""

from __future__ import annotations

from pathlib import Path

import triton

from framework.layers.kernels.launch_math import cdiv, next_power_of_2

ROOT = Path(__file__).resolve().parents[2]


def test_same_results_as_triton():
    sizes = list(range(-9, 4200)) + [2**31 - 1, 2**31, 2**31 + 1, 151_936, 10**12]
    for n in sizes:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_no_package_calls_tritons_host_helpers():
    calls = [
        f"{path.relative_to(ROOT)}:{number}"
        for package in ("framework", "samplers", "speculators", "model_states")
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "triton.cdiv(" in line or "triton.next_power_of_2(" in line
    ]
    assert calls == [], f"use framework.layers.kernels.launch_math instead of Triton's constexpr functions: {calls}"
