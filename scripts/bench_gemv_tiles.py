"""Sweep the small-batch kernels' launch shapes (`GemvTiles`: rows and warps per program, K chunk) at real shapes.

For each projection of a decode layer (Qwen3-0.6B and -8B geometries, bf16, random weights) and the LM head, at
M = 1, 2, 4 and 8 tokens: cuBLAS (`F.linear`, with the separate RMSNorm / SiLU kernels where the GEMV fuses
them), `gemv_tiles`' default shape, the GEMV with each candidate shape (rows labelled `gemv ...`) and, from two
tokens on, the tensor-core dot kernel (`triton_gemv_dot`) with each of its candidates (`dot ...`, pipeline
stages `s`; its default rule is an unmeasured guess). Each kernel is first compared
with the reference (`fused_linear_reference`), then timed as the median of CUDA-graph replays with L2 flushed
(`bench_small_batch.graph_time_us`). `GB/s` is weight bytes over time (HBM3e peak ~4,800).

    PYTHONPATH=$PWD python3 scripts/bench_gemv_tiles.py --out bench_results/gemv_tiles [--geometries qwen3-0.6b]
        [--tokens 2 8] [--kernels dot]

Prints a table per (geometry, op, M) as it goes, writes `gemv_tiles.json` after each and `gemv_tiles.png` at
the end (best GEMV, best dot, default and cuBLAS per op). The rules in `gemv_tiles` come from this sweep.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_small_batch import GEOMETRIES, graph_time_us  # noqa: E402

from framework.layers.kernels.layer_ops import rms_norm, silu_and_mul  # noqa: E402
from framework.layers.kernels.small_batch_ops import fused_linear_reference  # noqa: E402
from framework.layers.kernels.triton_gemv import GemvTiles, gemv_tiles, gemv_triton  # noqa: E402

EPS = 1e-6
CANDIDATES = [(4, 1024, 4), (8, 512, 8), (8, 1024, 8), (8, 2048, 8), (16, 1024, 8), (8, 1024, 4), (16, 512, 16)]
# The dot kernel's (block_n, block_k, num_warps, num_stages): 64 / 128 rows are Hopper warpgroup MMAs; 16 / 32
# rows fall back to mma.sync but give 4-8x more programs at N = 1024 (64 rows: 16 programs for 132 SMs).
DOT_CANDIDATES = [
    (16, 128, 1, 4),
    (32, 128, 2, 4),
    (32, 256, 2, 3),
    (64, 64, 4, 6),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (128, 128, 4, 4),
    (128, 128, 8, 4),
    (128, 64, 8, 6),
]


def op_inputs(geometry: str, op: str, m: int, device: str) -> dict:
    """The GEMV's arguments for one projection (the weight [N, K] or [2N, K] for gate_up)."""
    hidden, qkv_rows, inter, vocab = GEOMETRIES[geometry]
    n, k, fused = {
        "qkv": (qkv_rows, hidden, "norm"),
        "o_proj": (hidden, qkv_rows - 2048, None),
        "gate_up": (2 * inter, hidden, "norm_silu"),
        "down": (hidden, inter, None),
        "lm_head": (vocab, hidden, "fp32"),
    }[op]
    g = torch.Generator(device=device).manual_seed(m)
    args: dict = {
        "x": torch.randn(m, k, generator=g, device=device).to(torch.bfloat16),
        "weight": (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(torch.bfloat16),
    }
    if fused in ("norm", "norm_silu"):
        args.update(
            norm_weight=(1 + 0.1 * torch.randn(k, generator=g, device=device)).to(torch.bfloat16),
            eps=EPS,
            residual=torch.randn(m, k, generator=g, device=device).to(torch.bfloat16),
        )
    if fused == "norm_silu":
        args["silu_mul"] = True
    if fused == "fp32":
        args["out_dtype"] = torch.float32
    return args


def cublas_path(args: dict) -> Callable[[], torch.Tensor]:
    """What the default decode path runs for the same op: RMSNorm kernel, cuBLAS, SiLU-and-mul kernel."""

    def run() -> torch.Tensor:
        x = args["x"]
        if "norm_weight" in args:
            x, _ = rms_norm(x, args["norm_weight"], EPS, args["residual"])
        y = F.linear(x, args["weight"])
        if args.get("silu_mul"):
            y = silu_and_mul(y)
        return y.float() if args.get("out_dtype") == torch.float32 else y

    return run


def sweep_one(geometry: str, op: str, m: int, device: str, kernels: tuple[str, ...] = ("gemv", "dot")) -> dict:
    args = op_inputs(geometry, op, m, device)
    weight = args["weight"]
    n = weight.shape[0] // (2 if args.get("silu_mul") else 1)
    ref, _ = fused_linear_reference(
        **{
            **args,
            "x": args["x"].float(),
            "weight": weight.float(),
            **(
                {"norm_weight": args["norm_weight"].float(), "residual": args["residual"].float()}
                if "norm_weight" in args
                else {}
            ),
        }
    )
    mb = weight.numel() * weight.element_size() / 1e6
    rows: list[dict] = [{"tiles": "cublas", "us": graph_time_us(cublas_path(args))}]
    k, size, silu = weight.shape[1], weight.element_size(), bool(args.get("silu_mul"))
    default = gemv_tiles(m, n, k, size, silu_mul=silu)
    candidates = [
        gemv_tiles(m, n, k, size, block_n=bn, block_k=bk, num_warps=nw, dot=False)
        for bn, bk, nw in CANDIDATES
        if "gemv" in kernels
    ]
    if m >= 2 and "dot" in kernels:  # the dot kernel pads the tokens to 16: one row is the GEMV's job
        candidates += [
            gemv_tiles(m, n, k, size, block_n=bn, block_k=bk, num_warps=nw, dot=True, num_stages=ns, silu_mul=silu)
            for bn, bk, nw, ns in DOT_CANDIDATES
        ]
    shapes = [("default " + _name(default), default)]
    for tiles in dict.fromkeys(candidates):  # stages capped to shared memory can make two candidates one
        if tiles != default:
            shapes.append((_name(tiles), tiles))
    for name, tiles in shapes:
        try:
            out, _ = gemv_triton(**args, tiles=tiles)
        except Exception as e:  # a shape that does not compile or launch: reported, the sweep goes on
            rows.append({"tiles": name, "us": None, "error": f"{type(e).__name__}: {str(e)[:80]}"})
            continue
        err = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        if err > 2e-2:  # bf16 rounding of inputs and outputs: a wrong kernel is off by O(1)
            rows.append({"tiles": name, "us": None, "error": f"relative max diff {err:.3g}"})
            continue
        rows.append({"tiles": name, "us": graph_time_us(lambda: gemv_triton(**args, tiles=tiles))})
    for row in rows:
        row["gb_s"] = round(mb / 1e3 / (row["us"] * 1e-6), 1) if row["us"] else None
    return {"geometry": geometry, "op": op, "m": m, "weight_mb": round(mb, 1), "rows": rows}


def _name(t: GemvTiles) -> str:
    if t.dot:
        return f"dot n{t.block_n}/k{t.block_k}/w{t.num_warps}/s{t.num_stages}"
    return f"gemv n{t.block_n}/k{t.block_k}/w{t.num_warps}"


def print_case(case: dict) -> None:
    print(f"\n{case['geometry']} {case['op']} M={case['m']} ({case['weight_mb']} MB)")
    print("| tiles | us | GB/s |\n|---|---|---|")
    for row in case["rows"]:
        us = f"{row['us']:.2f}" if row["us"] else row.get("error", "-")
        print(f"| {row['tiles']} | {us} | {row['gb_s'] or '-'} |")


def plot(cases: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c['geometry'][6:]} {c['op']} M{c['m']}" for c in cases]
    series: dict[str, list[float]] = {"cublas": [], "default": [], "best gemv": [], "best dot": []}
    for c in cases:
        timed = [r for r in c["rows"] if r["us"]]
        series["cublas"].append(next(r["gb_s"] for r in timed if r["tiles"] == "cublas"))
        series["default"].append(next((r["gb_s"] for r in timed if r["tiles"].startswith("default")), 0))
        for kind in ("gemv", "dot"):  # the default row counts for its kind
            series[f"best {kind}"].append(
                max((r["gb_s"] for r in timed if r["tiles"].removeprefix("default ").startswith(kind + " ")), default=0)
            )
    fig, ax = plt.subplots(figsize=(max(8, len(cases) * 0.6), 4.5))
    width = 0.2
    for i, (name, values) in enumerate(series.items()):
        ax.bar([j + (i - 1.5) * width for j in range(len(cases))], values, width, label=name)
    ax.set_xticks(range(len(cases)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("weight GB/s")
    ax.set_title("small-batch GEMV / dot launch shapes (H200, bf16)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES))
    parser.add_argument("--ops", nargs="+", default=["qkv", "o_proj", "gate_up", "down", "lm_head"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=["gemv", "dot"],
        default=["gemv", "dot"],
        help="whose candidates to time (cuBLAS and the default shape always are)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/gemv_tiles"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the interpreter tests cover the kernel's values on a CPU)")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    cases: list[dict] = []
    start = time.monotonic()
    for geometry in args.geometries:
        for op in args.ops:
            for m in args.tokens:
                cases.append(sweep_one(geometry, op, m, "cuda", tuple(args.kernels)))
                print_case(cases[-1])
                print(f"[{len(cases)} cases, {time.monotonic() - start:.0f} s]", flush=True)
                (args.out / "gemv_tiles.json").write_text(json.dumps(cases, indent=1))
    plot(cases, args.out / "gemv_tiles.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
