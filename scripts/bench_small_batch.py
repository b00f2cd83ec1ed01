"""Benchmark the small-batch GEMV path against today's decode projections, per layer and for the LM head, on a GPU.

Geometries (bfloat16, random weights): Qwen3-0.6B (hidden 1024, q/k/v 2048/1024/1024, intermediate 3072) and
Qwen3-8B (hidden 4096, q/k/v 4096/1024/1024, intermediate 12288); both with the 151,936-row LM head. At
M = 1, 2, 4, 8 tokens, per op:

* `qkv`: add + RMSNorm (Triton) and the qkv GEMM (cuBLAS) vs one `fused_linear` (add + norm + GEMV);
* `o_proj`, `down`: the GEMM vs the GEMV;
* `gate_up`: add + RMSNorm, the gate_up GEMM and silu_and_mul vs one GEMV with both fused;
* `layer`: the four above in sequence (everything of a layer but q/k norm + RoPE + store and attention, which
  both paths share);
* `lm_head`: `F.linear(...).float()` vs the GEMV writing float32.

For `qkv`, `gate_up` and `layer` a third time, `norm apart`: the RMSNorm kernel, then the GEMV without its norm
prologue (one launch more, but no program re-reads the input from L2): whether fusing the norm pays.

Times are medians of `triton.testing.do_bench` over CUDA-graph replays of one call (GPU time, L2 flushed
between replays: a decode step's 28 layers do not fit in L2 either), in microseconds; `GB/s` is the weight bytes
over the time. Each pair is checked against each other first (max |diff|). Prints a table, writes
`small_batch_bench.json` and `small_batch_bench.png` into `--out`.

    PYTHONPATH=$PWD python3 scripts/bench_small_batch.py --out bench_results/small_batch [--tokens 1 2 4 8]

`--check-only` compares once without timing (a CPU under TRITON_INTERPRET=1 with a small `--scale`).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Optional, TypeVar

import torch
from torch.nn import functional as F

T = TypeVar("T")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.layers.kernels import layer_ops, small_batch_ops  # noqa: E402

# name -> (hidden, q + k + v rows, intermediate, vocab)
GEOMETRIES = {"qwen3-0.6b": (1024, 4096, 3072, 151936), "qwen3-8b": (4096, 6144, 12288, 151936)}
DTYPE, EPS = torch.bfloat16, 1e-6


class Pair(NamedTuple):
    op: str
    weight_bytes: int
    default: Callable[[], torch.Tensor]
    small: Callable[[], torch.Tensor]
    norm_apart: Optional[Callable[[], torch.Tensor]] = None  # the GEMV after a separate RMSNorm launch


def build_pairs(geometry: str, tokens: int, device: str, scale: int, backend: str = "auto") -> list[Pair]:
    # every op with the chosen kernels.backend (auto: Triton on CUDA; --backend triton under the interpreter)
    fused_linear = functools.partial(small_batch_ops.fused_linear, backend=backend)
    rms_norm = functools.partial(layer_ops.rms_norm, backend=backend)
    silu_and_mul = functools.partial(layer_ops.silu_and_mul, backend=backend)
    hidden, qkv_rows, inter, vocab = (d // scale for d in GEOMETRIES[geometry])
    attn_width = qkv_rows - 2 * (1024 // scale)  # q heads * head_dim (2 KV heads of 512 columns each, both models)
    g = torch.Generator(device=device).manual_seed(tokens)

    def randn(*shape: int, std: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * std + shift).to(DTYPE)

    x, residual, attn_out = randn(tokens, hidden), randn(tokens, hidden, std=4.0), randn(tokens, attn_width)
    act = randn(tokens, inter)
    w_in, w_post = randn(hidden, std=0.2, shift=1.0), randn(hidden, std=0.2, shift=1.0)
    w_qkv, w_o = randn(qkv_rows, hidden, std=hidden**-0.5), randn(hidden, attn_width, std=attn_width**-0.5)
    w_gate_up, w_down = randn(2 * inter, hidden, std=hidden**-0.5), randn(hidden, inter, std=inter**-0.5)
    w_lm = randn(vocab, hidden, std=hidden**-0.5)

    def default_qkv() -> torch.Tensor:
        return F.linear(rms_norm(x, w_in, EPS, residual)[0], w_qkv)

    def default_gate_up() -> torch.Tensor:
        return silu_and_mul(F.linear(rms_norm(x, w_post, EPS, residual)[0], w_gate_up))

    def small_qkv() -> torch.Tensor:
        return fused_linear(x, w_qkv, None, w_in, EPS, residual)[0]

    def small_gate_up() -> torch.Tensor:
        return fused_linear(x, w_gate_up, None, w_post, EPS, residual, silu_mul=True)[0]

    def apart_qkv() -> torch.Tensor:
        return fused_linear(rms_norm(x, w_in, EPS, residual)[0], w_qkv)[0]

    def apart_gate_up() -> torch.Tensor:
        return fused_linear(rms_norm(x, w_post, EPS, residual)[0], w_gate_up, silu_mul=True)[0]

    def apart_layer() -> torch.Tensor:
        apart_qkv(), fused_linear(attn_out, w_o)[0], apart_gate_up()
        return fused_linear(act, w_down)[0]

    def default_layer() -> torch.Tensor:
        default_qkv(), F.linear(attn_out, w_o), default_gate_up()
        return F.linear(act, w_down)

    def small_layer() -> torch.Tensor:
        small_qkv(), fused_linear(attn_out, w_o)[0], small_gate_up()
        return fused_linear(act, w_down)[0]

    nbytes = {
        name: w.numel() * w.element_size()
        for name, w in dict(qkv=w_qkv, o=w_o, gate_up=w_gate_up, down=w_down, lm=w_lm).items()
    }
    return [
        Pair("qkv", nbytes["qkv"], default_qkv, small_qkv, apart_qkv),
        Pair("o_proj", nbytes["o"], lambda: F.linear(attn_out, w_o), lambda: fused_linear(attn_out, w_o)[0]),
        Pair("gate_up", nbytes["gate_up"], default_gate_up, small_gate_up, apart_gate_up),
        Pair("down", nbytes["down"], lambda: F.linear(act, w_down), lambda: fused_linear(act, w_down)[0]),
        Pair("layer", sum(nbytes[k] for k in ("qkv", "o", "gate_up", "down")), default_layer, small_layer, apart_layer),
        Pair(
            "lm_head",
            nbytes["lm"],
            lambda: F.linear(x, w_lm).float(),
            lambda: fused_linear(x, w_lm, out_dtype=torch.float32)[0],
        ),
    ]


def capture_graph(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """A CUDA graph of one call of `fn` and that call's outputs (run once on a side stream first, so the
    capture holds no compile and the allocator is warm)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_time_us(fn: Callable[[], object]) -> float:
    """Median microseconds per replay of a CUDA graph of one call."""
    import triton.testing

    graph, _ = capture_graph(fn)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geometries = sorted({r["geometry"] for r in rows})
    fig, axes = plt.subplots(1, len(geometries), figsize=(7 * len(geometries), 4), squeeze=False)
    for ax, geometry in zip(axes[0], geometries):
        for op, marker in (("layer", "o"), ("lm_head", "s")):
            sel = [r for r in rows if r["geometry"] == geometry and r["op"] == op]
            for key, style in (("default_us", "--"), ("small_us", "-")):
                ax.plot(
                    [r["tokens"] for r in sel],
                    [r[key] for r in sel],
                    style,
                    marker=marker,
                    label=f"{op} {key.split('_')[0]}",
                )
        ax.set(
            title=f"{geometry} (bf16): projections per layer / LM head",
            xlabel="tokens (M)",
            ylabel="us per call (CUDA graph)",
            xscale="log",
            xticks=[1, 2, 4, 8],
        )
        ax.set_xticklabels(["1", "2", "4", "8"])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results/small_batch"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    parser.add_argument("--check-only", action="store_true", help="compare the paths once, no timing")
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension (CPU smoke runs)")
    parser.add_argument(
        "--backend", default="auto", choices=["auto", "triton", "reference"], help="kernels.backend of every op"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.check_only:
        parser.error("timing needs a CUDA GPU (use --check-only on a CPU under TRITON_INTERPRET=1)")
    rows: list[dict] = []
    print(
        f"{'geometry':<12}{'op':<9}{'M':>3}{'max|diff|':>11}{'default us':>12}{'GEMV us':>10}{'x':>6}"
        f"{'default GB/s':>14}{'GEMV GB/s':>11}{'norm apart us':>15}"
    )
    for geometry in args.geometries:
        for tokens in args.tokens:
            for pair in build_pairs(geometry, tokens, device, args.scale, args.backend):
                reference = pair.default().float()
                diff = max(
                    (fn().float() - reference).abs().max().item()
                    for fn in (pair.small, pair.norm_apart)
                    if fn is not None
                )
                row = dict(
                    geometry=geometry, op=pair.op, tokens=tokens, max_abs_diff=diff, weight_bytes=pair.weight_bytes
                )
                line = f"{geometry:<12}{pair.op:<9}{tokens:>3}{diff:>11.3g}"
                if not args.check_only:
                    row["default_us"], row["small_us"] = graph_time_us(pair.default), graph_time_us(pair.small)
                    gbps = [pair.weight_bytes / (row[k] * 1e3) for k in ("default_us", "small_us")]
                    line += (
                        f"{row['default_us']:>12.1f}{row['small_us']:>10.1f}"
                        f"{row['default_us'] / row['small_us']:>6.2f}{gbps[0]:>14.0f}{gbps[1]:>11.0f}"
                    )
                    if pair.norm_apart is not None:  # is fusing the norm into the GEMV worth its L2 reads?
                        row["norm_apart_us"] = graph_time_us(pair.norm_apart)
                        line += f"{row['norm_apart_us']:>15.1f}"
                rows.append(row)
                print(line, flush=True)
    meta = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        torch=torch.__version__,
        dtype=str(DTYPE),
        unit="microseconds per CUDA-graph replay (median, L2 flushed)",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "small_batch_bench.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    if not args.check_only:
        plot(rows, args.out / "small_batch_bench.png")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
