"""The host's speed around each benchmark run, and comparisons that hold it equal.

The H200 machine's host (a KVM guest) runs pure Python at one speed for a while and at half that speed for a
while, on every core at once (a diagnostic since removed, at commit 8b42fb6:scripts/diag/diag_host_speed.py: a
fixed loop took 0.7 or 1.3-1.5 ms; steal time stayed ~0). Small-batch decode steps are bound by the host, so a
run's tokens/s follow that state, by 30-60 %, which swamps the few percent two draft-length policies differ by.
Each run is therefore bracketed by a probe (`host_probe_us`, the slower of one before and one after it), and a
run counts as *fast-host* when its probe took under `FAST_HOST` times the fastest probe of the benchmark. Runs
are compared round by round (`paired_ratio`: both policies back to back), over every round and over the rounds
where both runs were fast-host.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

FAST_HOST = 1.3  # fast-host: the probe took < 1.3x the fastest (the two states measure ~1x and 1.9-2.2x)


def probe_once_us() -> float:
    """Microseconds a fixed piece of pure-Python work takes, once."""
    t0 = time.perf_counter()
    acc = 0
    for i in range(20000):
        acc += i & 7
    return 1e6 * (time.perf_counter() - t0)


def host_probe_us() -> float:
    """The best of 3 `probe_once_us` (a probe must not itself be one scheduling hiccup)."""
    return round(min(probe_once_us() for _ in range(3)), 1)


def fastest_probe(runs: Sequence[dict[str, Any]], fastest: float = float("inf")) -> float:
    """The fastest probe among these runs' (`host_probes_us`) and `fastest`."""
    return min([fastest] + [min(r["host_probes_us"]) for r in runs])


def fast_runs(values: Sequence[float], probes: Sequence[float], fastest: float) -> list[float]:
    """The values of the fast-host runs."""
    return [v for v, p in zip(values, probes) if p < FAST_HOST * fastest]


def median(values: Sequence[float]) -> Optional[float]:
    """The middle value (the upper one of an even count), None for no values."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def fastest_policy(runs: dict[str, tuple[Sequence[float], Sequence[float]]], fastest: float) -> str:
    """The name whose runs (tokens/s, probes) have the highest median: over fast-host runs when every policy
    has one, else over all runs (a fast-host median against an all-runs one would compare host states)."""
    fast = {name: fast_runs(values, probes, fastest) for name, (values, probes) in runs.items()}
    use = fast if all(fast.values()) else {name: list(values) for name, (values, _) in runs.items()}
    return max(use, key=lambda name: median(use[name]) or 0.0)


def paired_ratio(dynamic: dict[str, Any], fixed: dict[str, Any], fastest: float) -> dict[str, Any]:
    """Dynamic-k's tokens/s over a fixed k's round by round (`runs_tok_per_s`, `runs_host_probe_us` of two
    rows whose runs alternate back to back): the median and quartiles over every round, and the median over
    the rounds where both runs were fast-host (`fast`)."""
    ratios = [d / f for d, f in zip(dynamic["runs_tok_per_s"], fixed["runs_tok_per_s"])]
    both = [max(a, b) for a, b in zip(dynamic["runs_host_probe_us"], fixed["runs_host_probe_us"])]
    fast = fast_runs(ratios, both, fastest)
    ordered, n = sorted(ratios), len(ratios)
    return {
        "ratios": [round(x, 4) for x in ratios],
        "median": round(ordered[n // 2], 4),
        "quartiles": [round(ordered[n // 4], 4), round(ordered[(3 * n) // 4 if n > 1 else 0], 4)],
        "rounds": n,
        "fast": {"median": round(median(fast), 4) if fast else None, "rounds": len(fast)},
    }


if __name__ == "__main__":  # one probe, for shell jobs: "host probe us N"
    print(f"host probe us {host_probe_us():.1f}")
