"""How the attention benchmarks time a call: replayed from a CUDA graph (as the engine runs decode), eagerly, and
the host's cost per launch."""

from __future__ import annotations

import time

import torch

from benchmarks.cuda_timing import time_eager_ms, time_graph_ms

__all__ = ["host_us", "time_graph_ms", "time_ms"]


def time_ms(fn) -> float:  # type: ignore[no-untyped-def]
    """Median time of eager calls (host launch overhead shows when it exceeds the GPU time)."""
    return time_eager_ms(fn)


def host_us(fn, calls: int = 200) -> float:
    """Host time per call (launches are asynchronous, so this is the CPU cost of one call)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6
