"""Benchmark the fused per-layer Triton ops against the unfused PyTorch sequences they replace, on a CUDA GPU.

Qwen3-0.6B shapes, bfloat16: hidden 1024, intermediate 3072, 16 query heads, 8 KV heads, head_dim 128, KV blocks
of 16 tokens; T = 1 and 256 tokens by default. Per op (fused = one Triton launch; unfused = what
`framework/models/llama.py` ran before the fusion, i.e. the PyTorch references):

* `add+rms_norm`: residual add + RMSNorm (`rms_norm(x, w, eps, residual)`) vs `x + r` and the HF RMSNorm ops.
* `rms_norm`: RMSNorm alone (the first layer's input norm).
* `silu_and_mul`: `silu(gate) * up` of the merged gate/up output vs `F.silu(g) * u`.
* `qk_norm_rope_store`: per-head q/k RMSNorm, RoPE on q and k and the KV-cache store vs the reference norms,
  `apply_rope_reference` twice and the Triton `store_kv` (the unfused decode path on a GPU).

Times (microseconds per call, medians of `triton.testing.do_bench`): `eager` includes the host launch cost
of every kernel, which is what a long chain of tiny kernels loses; `graph` replays a CUDA graph of the call,
as a captured decode step does (GPU time only). Before timing, each fused output is checked against the
unfused one. Prints a table and writes JSON to `--out`. Takes well under a minute on an H200 (mostly
compiling).

    PYTHONPATH=$PWD python3 scripts/bench_layer_ops.py --out layer_ops_bench.json [--tokens 1 256] [--qk-grids 1 64 8192]

`--check-only` runs every pair once and compares without timing (works on a CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.layers.attention.triton_store_kv import store_kv  # noqa: E402
from framework.layers.kernels.layer_ops import apply_rope_reference, rms_norm_reference, silu_and_mul_reference  # noqa: E402
from framework.layers.kernels.triton_norm_silu import rms_norm_triton, silu_and_mul_triton  # noqa: E402
from framework.layers.kernels.triton_qk_norm_rope import ONE_HEAD_TOKENS, qk_norm_rope_store_triton  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, EPS = 1024, 3072, 16, 8, 128, 1e-6
BLOCK_SIZE, NUM_BLOCKS = 16, 512
DTYPE = torch.bfloat16


class Case(NamedTuple):
    op: str
    tokens: int
    fused: Callable[[], object]
    unfused: Callable[[], object]
    compare: Callable[[object, object], float]  # max |fused - unfused| over the outputs that matter


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def build_cases(tokens: int, device: str) -> list[Case]:
    g = torch.Generator(device=device).manual_seed(tokens)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * scale + shift).to(DTYPE)

    x, residual = randn(tokens, HIDDEN), randn(tokens, HIDDEN, scale=4.0)
    norm_weight = randn(HIDDEN, scale=0.2, shift=1.0)
    gate_up = randn(tokens, 2 * INTER, scale=3.0)
    qkv = randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, scale=2.0)
    positions = torch.arange(tokens, device=device).float() + 100
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
    q_weight, k_weight = randn(HEAD_DIM, scale=0.2, shift=1.0), randn(HEAD_DIM, scale=0.2, shift=1.0)
    kv_slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=device)[:tokens]
    fused_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    unfused_cache = fused_cache.clone()

    def unfused_qk() -> torch.Tensor:
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = rms_norm_reference(q.view(tokens, HEADS, HEAD_DIM), q_weight, EPS)[0]
        k = rms_norm_reference(k.view(tokens, KV_HEADS, HEAD_DIM), k_weight, EPS)[0]
        q, k = apply_rope_reference(q, cos, sin), apply_rope_reference(k, cos, sin)
        store_kv(k, v.view(tokens, KV_HEADS, HEAD_DIM), unfused_cache, kv_slots)
        return q

    def compare_qk(fused_q: torch.Tensor, unfused_q: torch.Tensor) -> float:
        return max(_max_diff(fused_q, unfused_q), _max_diff(fused_cache, unfused_cache))

    return [
        Case(
            "add+rms_norm",
            tokens,
            lambda: rms_norm_triton(x, norm_weight, EPS, residual),
            lambda: rms_norm_reference(x, norm_weight, EPS, residual),
            lambda a, b: max(_max_diff(a[0], b[0]), _max_diff(a[1], b[1])),
        ),
        Case(
            "rms_norm",
            tokens,
            lambda: rms_norm_triton(x, norm_weight, EPS),
            lambda: rms_norm_reference(x, norm_weight, EPS),
            lambda a, b: _max_diff(a[0], b[0]),
        ),
        Case(
            "silu_and_mul",
            tokens,
            lambda: silu_and_mul_triton(gate_up),
            lambda: silu_and_mul_reference(gate_up),
            _max_diff,
        ),
        Case(
            "qk_norm_rope_store",
            tokens,
            lambda **grid: qk_norm_rope_store_triton(
                qkv, cos, sin, q_weight, k_weight, EPS, HEADS, KV_HEADS, HEAD_DIM, fused_cache, kv_slots, **grid
            ),
            unfused_qk,
            compare_qk,
        ),
    ]


def time_us(fn: Callable[[], object], graph: bool) -> float:
    """Median microseconds per call: eager launches, or replays of a CUDA graph of one call."""
    import triton.testing

    if not graph:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles and allocator warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        fn()
    return triton.testing.do_bench(cuda_graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def time_qk_grids(tokens_list: list[int], device: str) -> list[dict]:
    """q/k norm + RoPE + store as a graph replay with each of its grids forced (`one_head`): one head per
    program vs token x head tiles, at every T: where the wrapper's switch between them (ONE_HEAD_TOKENS)
    belongs."""
    rows = []
    print(f"\n{'qk_norm_rope_store T':<22}{'one head / program us':>23}{'tiles us':>10}{'today':>8}")
    for tokens in tokens_list:
        fused = next(c for c in build_cases(tokens, device) if c.op == "qk_norm_rope_store").fused
        row = dict(tokens=tokens, today="one_head" if tokens <= ONE_HEAD_TOKENS else "tiles")
        for grid, one_head in (("one_head", True), ("tiles", False)):
            row[f"{grid}_graph_us"] = time_us(lambda: fused(one_head=one_head), graph=True)
        print(
            f"{tokens:<22}{row['one_head_graph_us']:>23.1f}{row['tiles_graph_us']:>10.1f}{row['today']:>8}", flush=True
        )
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("layer_ops_bench.json"), help="JSON results file")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256], help="batch sizes T to time")
    parser.add_argument("--check-only", action="store_true", help="compare fused and unfused once, no timing")
    parser.add_argument(
        "--qk-grids",
        type=int,
        nargs="*",
        default=[],
        help="also time q/k norm + RoPE + store's two grids at these T (e.g. 1 8 32 64 256 8192)",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.check_only:
        parser.error("timing needs a CUDA GPU (use --check-only on a CPU under TRITON_INTERPRET=1)")
    rows = []
    header = (
        f"{'op':<20}{'T':>5}{'max|diff|':>11}{'fused eager':>13}{'unfused eager':>15}{'x':>6}"
        f"{'fused graph':>13}{'unfused graph':>15}{'x':>6}"
    )
    print(header)
    for tokens in args.tokens:
        for case in build_cases(tokens, device):
            diff = case.compare(case.fused(), case.unfused())
            row = dict(op=case.op, tokens=tokens, max_abs_diff=diff)
            if not args.check_only:
                for mode in ("eager", "graph"):
                    row[f"fused_{mode}_us"] = time_us(case.fused, graph=mode == "graph")
                    row[f"unfused_{mode}_us"] = time_us(case.unfused, graph=mode == "graph")
            rows.append(row)
            line = f"{case.op:<20}{tokens:>5}{diff:>11.3g}"
            if not args.check_only:
                for mode in ("eager", "graph"):
                    fused, unfused = row[f"fused_{mode}_us"], row[f"unfused_{mode}_us"]
                    line += f"{fused:>13.1f}{unfused:>15.1f}{unfused / fused:>6.1f}"
            print(line, flush=True)
    meta = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        torch=torch.__version__,
        dtype=str(DTYPE),
        hidden=HIDDEN,
        intermediate=INTER,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        unit="microseconds per call (median)",
    )
    qk_grids = time_qk_grids(args.qk_grids, device) if args.qk_grids and not args.check_only else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, results=rows, qk_grids=qk_grids), indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
