"""How the kernel benchmarks time a call on the GPU: CUDA events around eager calls, `triton.testing.do_bench`
eagerly, or a CUDA graph's replays (as the engine runs decode: no host overhead). Medians throughout."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_event_ms(fn: Callable[[], object], reps: int = 30, warmup: int = 3) -> float:
    """Median of `reps` eager calls, each between two CUDA events (compiles and caches warm up first)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_eager_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of eager calls by `do_bench` (host launch overhead shows when it exceeds the GPU time)."""
    from triton.testing import do_bench

    fn()  # compile outside the timing
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_graph_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median GPU time of `fn` replayed from a CUDA graph (captured after a warm-up call on a side stream)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = _captured(fn, calls=1)
    return float(do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median"))


def graph_event_ms(fn: Callable[[], object], reps: int = 10, target_ms: float = 1.0) -> float:
    """Median GPU time of one `fn` call: a CUDA graph of as many calls as last about `target_ms` (50 at most),
    replayed between CUDA events, so microsecond kernels are timed without host launch gaps."""
    one = median_event_ms(fn, reps=3, warmup=2)  # compiles, and sizes the graph
    calls = max(1, min(50, int(target_ms / max(one, 1e-3))))
    graph = _captured(fn, calls)
    return median_event_ms(graph.replay, reps=reps, warmup=2) / calls


def _captured(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of `fn`, captured after a warm-up call on a side stream (allocations and lazy
    initialisation happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph
