"""The decode projections at 32-256 rows through cuBLAS, with PyTorch's default BLAS and with cuBLASLt preferred.

nano's decode at 65-256 rows spends ~0.8 ms a step in its four projection GEMMs (docs/decode-performance-log.md,
issue 25's fifth session): ~28 us a layer for 30 MB of weights, far from both the bandwidth and the FLOP floor.
This times `F.linear` at the Qwen3-0.6B (and 8B) projection shapes, each in a CUDA graph of 28 calls on 28
distinct weights (as a step runs them, so the weights come from HBM, not L2), under
`torch.backends.cuda.preferred_blas_library` "cublas" (the default) and "cublaslt", and the same with the weights
stored transposed ([K, N], `x @ w`: cuBLAS sees an NN product instead of F.linear's TN and may pick other
kernels); prints a table (us per call, TB/s of weight bytes, TFLOP/s), writes `projections.json` and
`projections.png` into the directory given.

    PYTHONPATH=$PWD python3 scripts/bench_projections.py OUT_DIR [--rows 32 64 128 256] [--shapes "8b o" ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS = 28
SHAPES = {  # name: (N, K) of the fused weights the model runs
    "0.6b qkv": (4096, 1024),
    "0.6b o": (1024, 2048),
    "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072),
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (24576, 4096),
    "8b down": (4096, 12288),
}
VARIANTS = {
    "cublas": ("cublas", "nk"),
    "cublaslt": ("cublaslt", "nk"),  # name: (preferred BLAS, weight layout)
    "cublas kn": ("cublas", "kn"),
    "cublaslt kn": ("cublaslt", "kn"),
}


def time_chain_us(rows: int, n: int, k: int, layers: int, layout: str = "nk") -> float:
    """us per call: `layers` projections of distinct weights ([n, k] for F.linear, or [k, n] for `x @ w` with
    layout "kn") replayed from one CUDA graph (median)."""
    from triton.testing import do_bench

    shape = (n, k) if layout == "nk" else (k, n)
    weights = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    outs = []

    def chain() -> None:
        outs[:] = [F.linear(x, w) if layout == "nk" else x @ w for w in weights]

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    return float(do_bench(graph.replay, warmup=10, rep=50, return_mode="median")) * 1e3 / layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_projections needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    print(f"{'shape':>14} {'rows':>5} " + " ".join(f"{b + ' us':>12} {'TB/s':>5} {'TFLOP/s':>7}" for b in VARIANTS))
    for name in args.shapes:
        n, k = SHAPES[name]
        layers = LAYERS if n * k * 2 * LAYERS < 8e9 else 8  # the 8B's gate_up: 8 weights of 201 MB
        for rows in args.rows:
            r = dict(shape=name, n=n, k=k, rows=rows, layers=layers)
            for backend, (blas, layout) in VARIANTS.items():
                torch.backends.cuda.preferred_blas_library(blas)
                us = time_chain_us(rows, n, k, layers, layout)
                r[backend] = dict(us=us, tbps=n * k * 2 / us / 1e6, tflops=2 * rows * n * k / us / 1e6)
            torch.backends.cuda.preferred_blas_library("cublas")
            results.append(r)
            print(
                f"{name:>14} {rows:>5} "
                + " ".join(f"{r[b]['us']:>12.1f} {r[b]['tbps']:>5.2f} {r[b]['tflops']:>7.0f}" for b in VARIANTS),
                flush=True,
            )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "projections.json").write_text(
        json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, results=results), indent=1)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r['shape']} x{r['rows']}" for r in results]
    for i, b in enumerate(VARIANTS):
        ax.bar([j + 0.2 * i for j in range(len(results))], [r[b]["tbps"] for r in results], 0.2, label=b)
    ax.set_xticks([j + 0.3 for j in range(len(results))], labels, rotation=90, fontsize=6)
    ax.set(ylabel="weight bytes / time (TB/s)", title="Decode projections (bf16), 28 distinct weights a graph")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out_dir / "projections.png", dpi=120)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
