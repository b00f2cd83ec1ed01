"""How the attention benchmarks time a call: replayed from a CUDA graph (as the engine runs decode), eagerly, and
the host's cost per launch."""

from __future__ import annotations

import time

import torch


def time_ms(fn) -> float:
    """Median time of eager calls (host launch overhead shows when it exceeds the GPU time)."""
    from triton.testing import do_bench

    fn()  # compile outside the timing
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def time_graph_ms(fn) -> float:
    """Median GPU time of `fn` replayed from a CUDA graph, as the engine runs decode (no host overhead)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return float(do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))


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
