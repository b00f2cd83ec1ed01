"""The decode projections at 32-256 rows: cuBLAS (PyTorch's default BLAS and cuBLASLt preferred) against the
split-K Triton GEMM (framework/kernels/triton_gemm.py), its rule and a sweep of launch shapes.

nano's decode at 65-256 rows spends ~0.8 ms a step in its four projection GEMMs (docs/benchmarks.md, issue 25's
fifth session): ~28 us a layer for 30 MB of weights, far from both the bandwidth and the FLOP floor. Each
candidate runs in a CUDA graph of 28 calls on 28 distinct weights (as a step runs them, so the weights come from
HBM, not L2); "gate_up+silu" is the merged gate/up projection followed by SiLU * up (cuBLAS: `F.linear` then the
`silu_and_mul` kernel; Triton: the fused epilogue). Every Triton candidate is checked against `F.linear` first.
Prints a table (us per call, TB/s of weight bytes), writes `projections.json` (every candidate) and
`projections.png` into the directory given.

    PYTHONPATH=$PWD python3 scripts/bench_projections.py OUT_DIR [--rows 32 64 128 256] [--no-sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from framework.kernels.layer_ops import silu_and_mul
from framework.kernels.split_counters import SplitCounters
from framework.kernels.triton_gemm import GemmConfig, gemm_config, gemm_triton

LAYERS = 28
SHAPES = {  # name: (N, K, silu_mul) of the fused weights the model runs (N: output columns)
    "0.6b qkv": (4096, 1024, False), "0.6b o": (1024, 2048, False), "0.6b gate_up": (6144, 1024, False),
    "0.6b gate_up+silu": (3072, 1024, True), "0.6b down": (1024, 3072, False),
    "8b qkv": (6144, 4096, False), "8b o": (4096, 4096, False), "8b gate_up+silu": (12288, 4096, True),
    "8b down": (4096, 12288, False),
}
SWEEP_SHAPES = ("0.6b qkv", "0.6b o", "0.6b gate_up+silu", "0.6b down")  # the 8B's: cuBLAS and the rule only
BACKENDS = ("cublas", "cublaslt")


def candidates(rows: int) -> list[GemmConfig]:
    """The sweep's launch shapes at `rows` tokens (stages: as many as fit, at most 4)."""
    block_ms = sorted({min(128, max(16, 1 << (rows - 1).bit_length())), min(64, max(16, rows))})
    return [GemmConfig(bn, bm, bk, sk, 8 if bn * bm >= 128 * 128 else 4, 4)
            for bn, bm, bk, sk in itertools.product((64, 128), block_ms, (64, 128), (1, 2, 4, 8))]


def time_graph_us(fn: Callable[[int], object], layers: int) -> float:
    """us per call: fn(0..layers-1) replayed from one CUDA graph (median)."""
    from triton.testing import do_bench

    for i in range(layers):  # compile / warm up outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    return float(do_bench(graph.replay, warmup=5, rep=25, return_mode="median")) * 1e3 / layers


def bench_shape(name: str, rows: int, sweep: bool) -> dict:
    n, k, silu = SHAPES[name]
    w_rows = 2 * n if silu else n
    layers = LAYERS if w_rows * k * 2 * LAYERS < 8e9 else 8  # the 8B's gate_up: 8 weights of 201 MB
    weights = [torch.randn(w_rows, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(layers)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0])
    ref = silu_and_mul(ref) if silu else ref
    weight_bytes = w_rows * k * 2
    r: dict = dict(shape=name, n=n, k=k, silu_mul=silu, rows=rows, layers=layers)

    def record(key: str, us: float) -> None:
        r[key] = dict(us=us, tbps=weight_bytes / us / 1e6)

    for backend in BACKENDS:
        torch.backends.cuda.preferred_blas_library(backend)
        record(backend, time_graph_us(lambda i: silu_and_mul(F.linear(x, weights[i])) if silu
                                      else F.linear(x, weights[i]), layers))
    torch.backends.cuda.preferred_blas_library("cublas")
    counters = SplitCounters()
    rule = gemm_config(rows, n, k, 2, silu)
    tried = [rule] + (candidates(rows) if sweep and name in SWEEP_SHAPES else [])
    r["triton"] = []
    for cfg in tried:
        out = gemm_triton(x, weights[0], silu_mul=silu, counters=counters, config=cfg)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        if err > 2e-2:
            raise AssertionError(f"{name} x{rows} {cfg}: relative error {err:.3g} against F.linear")
        us = time_graph_us(lambda i: gemm_triton(x, weights[i], silu_mul=silu, counters=counters, config=cfg),
                           layers)
        r["triton"].append(dict(config=cfg._asdict(), us=us, tbps=weight_bytes / us / 1e6, rule=cfg is rule))
    best = min(r["triton"], key=lambda t: t["us"])
    r["triton_rule"], r["triton_best"] = r["triton"][0], best
    return r


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"cublas": lambda r: r["cublas"]["tbps"], "cublaslt": lambda r: r["cublaslt"]["tbps"],
              "triton rule": lambda r: r["triton_rule"]["tbps"], "triton best": lambda r: r["triton_best"]["tbps"]}
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / len(series)
    for i, (label, get) in enumerate(series.items()):
        ax.bar([j + width * i for j in range(len(results))], [get(r) for r in results], width, label=label)
    ax.set_xticks([j + 0.4 for j in range(len(results))], [f"{r['shape']} x{r['rows']}" for r in results],
                  rotation=90, fontsize=6)
    ax.set(ylabel="weight bytes / time (TB/s)", title="Decode projections (bf16), 28 distinct weights a graph")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--no-sweep", action="store_true", help="the Triton rule only, no launch-shape sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_projections needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    print(f"{'shape':>18} {'rows':>5} {'cublas us':>10} {'lt us':>7} {'rule us':>8} {'best us':>8} "
          f"{'best TB/s':>9}  best config (bn, bm, bk, split, warps, stages)")
    for name in args.shapes:
        for rows in args.rows:
            r = bench_shape(name, rows, sweep=not args.no_sweep and rows >= 64)
            results.append(r)
            best = r["triton_best"]
            print(f"{name:>18} {rows:>5} {r['cublas']['us']:>10.1f} {r['cublaslt']['us']:>7.1f} "
                  f"{r['triton_rule']['us']:>8.1f} {best['us']:>8.1f} {best['tbps']:>9.2f}  "
                  f"{tuple(best['config'].values())}", flush=True)
            (args.out_dir / "projections.json").write_text(json.dumps(
                dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, results=results), indent=1))
    plot(results, args.out_dir / "projections.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
