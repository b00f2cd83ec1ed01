"""Benchmark the fused-MoE Triton kernels at Qwen3-30B-A3B's shapes on a CUDA GPU: achieved bandwidth and TFLOP/s.

One MoE layer: hidden 2048, 128 experts of intermediate 768, top-8, bfloat16, routing from random router logits
(softmax, top-8, renormalised). Token counts: decode batches 1 / 16 / 64 / 256 and a prefill batch of 8192.
Per token count, medians of `triton.testing.do_bench_cudagraph` (GPU time of a CUDA-graph replay, as a captured
decode step runs it) for

* `fused`: the whole `fused_moe_triton` call (expert alignment + gate/up kernel + down kernel + top-k sum);
* `kernels`: the two grouped-GEMM kernels alone (alignment precomputed);
* `reference`: `fused_moe_reference` (one cuBLAS GEMM per projection per expert, eager: host loop and syncs).

Reported: `weight_bytes` (the experts the routing touches, each read once: 3 * I * H * 2 bytes),
`min_bytes` (those weights plus the activations each kernel must read and write at least once), GB/s as
min_bytes / time, and TFLOP/s as 6 * tokens * top_k * I * H / time. Decode is bandwidth-bound (compare GB/s
with the ~4.3 TB/s measured copy bandwidth of an H200), prefill compute-bound (~990 dense bf16 TFLOP/s peak).
Before timing, each output is checked against the reference. Prints a table, writes JSON and a plot to `--out`.
Takes well under a minute on an H200.

    PYTHONPATH=$PWD python3 scripts/bench_fused_moe.py --out moe_bench [--tokens 1 16 64 256 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.layers.kernels import fused_moe as fm  # noqa: E402
from framework.layers.kernels.moe_align import moe_align  # noqa: E402
from framework.layers.kernels.moe_route import moe_route_reference  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
DTYPE = torch.bfloat16
COPY_BANDWIDTH_GBS = 4300.0  # measured H200 copy bandwidth (DESIGN.md)


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(DTYPE)
    weights, ids = moe_route_reference(
        torch.randn(tokens, EXPERTS, generator=g, device="cuda"), TOP_K, True, torch.float32
    )
    return x, weights, ids


def _kernels_only(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):  # type: ignore[no-untyped-def]
    """A closure launching only the two grouped-GEMM kernels (alignment and buffers made once, outside)."""
    import triton

    rows = ids.numel()
    cfg = fm.moe_launch_config(rows, EXPERTS)
    align = moe_align(ids, EXPERTS, cfg.block_m)
    blocks = align.block_expert.shape[0]
    act = torch.empty(rows, INTER, dtype=DTYPE, device="cuda")
    out = torch.empty(rows, HIDDEN, dtype=DTYPE, device="cuda")
    flat_w = weights.reshape(-1).float()
    tiles = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PRECISION="ieee",
        UPCAST=False,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )

    def run() -> None:
        fm._moe_gate_up_kernel[(blocks, triton.cdiv(INTER, cfg.block_n))](
            x,
            gate_up,
            act,
            align.sorted_rows,
            align.block_expert,
            align.num_padded,
            rows,
            x.stride(0),
            H=HIDDEN,
            I=INTER,
            TOP_K=TOP_K,
            **tiles,
        )
        fm._moe_down_kernel[(blocks, triton.cdiv(HIDDEN, cfg.block_n))](
            act,
            down,
            flat_w,
            out,
            align.sorted_rows,
            align.block_expert,
            align.num_padded,
            rows,
            H=HIDDEN,
            I=INTER,
            **tiles,
        )

    return run


def _time(fn, modes: dict[str, str], name: str) -> float:  # type: ignore[no-untyped-def]
    """Median ms of a CUDA-graph replay of `fn`; eager `do_bench` (recorded in `modes`) if capture fails."""
    import triton.testing

    try:
        ms = triton.testing.do_bench_cudagraph(fn)
        modes[name] = "cuda_graph"
    except Exception as err:  # a capture failure must not lose the other numbers
        print(f"{name}: CUDA-graph capture failed ({type(err).__name__}: {err}); timing eagerly", file=sys.stderr)
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn)
        modes[name] = "eager"
    return ms


def bench(tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> dict:
    import triton.testing

    x, weights, ids = _inputs(tokens, seed=tokens)
    ref = fm.fused_moe_reference(x, gate_up, down, weights, ids)
    out = fm.fused_moe_triton(x, gate_up, down, weights, ids)
    rel_err = ((out.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()
    if rel_err > 1e-2:
        raise SystemExit(f"{tokens} tokens: fused output differs from the reference (relative RMS {rel_err:.2e})")
    modes: dict[str, str] = {}
    times = {
        "fused": _time(lambda: fm.fused_moe_triton(x, gate_up, down, weights, ids), modes, "fused"),
        "kernels": _time(_kernels_only(x, gate_up, down, weights, ids), modes, "kernels"),
        "reference": triton.testing.do_bench(lambda: fm.fused_moe_reference(x, gate_up, down, weights, ids)),
    }
    modes["reference"] = "eager"
    rows = tokens * TOP_K
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * 3 * INTER * HIDDEN * 2
    # x read once per token, act written and read, per-choice outputs written and read, output written.
    act_bytes = (tokens * HIDDEN + 2 * rows * INTER + 2 * rows * HIDDEN + tokens * HIDDEN) * 2
    min_bytes = weight_bytes + act_bytes
    flops = 6 * rows * INTER * HIDDEN
    result = {
        "tokens": tokens,
        "rows": rows,
        "experts_touched": touched,
        "launch_config": fm.moe_launch_config(rows, EXPERTS)._asdict(),
        "weight_bytes": weight_bytes,
        "min_bytes": min_bytes,
        "flops": flops,
        "relative_rms_error": rel_err,
        "timing_modes": modes,
    }
    for name, ms in times.items():
        result[name] = {"ms": ms, "gb_per_s": min_bytes / ms / 1e6, "tflop_per_s": flops / ms / 1e9}
    return result


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw, tf) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [str(r["tokens"]) for r in results]
    for name in ("fused", "kernels", "reference"):
        bw.plot(labels, [r[name]["gb_per_s"] for r in results], marker="o", label=name)
        tf.plot(labels, [r[name]["tflop_per_s"] for r in results], marker="o", label=name)
    bw.axhline(COPY_BANDWIDTH_GBS, color="grey", linestyle="--", label="H200 copy bandwidth")
    bw.set(title="achieved bandwidth (min bytes / time)", xlabel="tokens", ylabel="GB/s")
    tf.set(title="achieved compute", xlabel="tokens", ylabel="TFLOP/s", yscale="log")
    bw.legend()
    tf.legend()
    fig.suptitle("fused MoE, Qwen3-30B-A3B layer (128 experts, top-8, H 2048, I 768, bf16), one H200")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for bench_fused_moe.json and .png")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 8192])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_moe needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2, INTER, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5).to(DTYPE)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") * INTER**-0.5).to(DTYPE)
    results = [bench(t, gate_up, down) for t in args.tokens]
    header = (
        f"{'tokens':>6} {'experts':>7} {'fused ms':>9} {'GB/s':>7} {'TFLOP/s':>8} {'kernels ms':>10} "
        f"{'GB/s':>7} {'TFLOP/s':>8} {'ref ms':>8} {'speedup':>7}"
    )
    print(header)
    for r in results:
        f, k, ref = r["fused"], r["kernels"], r["reference"]
        print(
            f"{r['tokens']:>6} {r['experts_touched']:>7} {f['ms']:>9.4f} {f['gb_per_s']:>7.0f} "
            f"{f['tflop_per_s']:>8.1f} {k['ms']:>10.4f} {k['gb_per_s']:>7.0f} {k['tflop_per_s']:>8.1f} "
            f"{ref['ms']:>8.3f} {ref['ms'] / f['ms']:>6.1f}x"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "hidden": HIDDEN,
        "intermediate": INTER,
        "experts": EXPERTS,
        "top_k": TOP_K,
        "dtype": str(DTYPE),
    }
    (args.out / "bench_fused_moe.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    _plot(results, args.out / "bench_fused_moe.png")


if __name__ == "__main__":
    main()
