"""Gated DeltaNet prefill: the recurrent Triton kernel (token by token) against the chunked one (64-token
chunks as matrix products), at Qwen3.5's linear-attention shapes (16 key heads, 32 value heads, 128 x 128 state).

For each batch shape (rows x tokens per row, bf16 q/k/v, float32 state) the median time of one layer's delta
rule over `--reps` CUDA-event-timed runs, prefill tokens per second, and the chunked kernel's speed-up; the
chunked kernel is also swept over its Dv block and warp count (the first row of the sweep is the default the
dispatch uses). Prints a table, writes JSON.

    PYTHONPATH=$PWD python benchmarks/gdn/bench_gdn_prefill.py [--out gdn_prefill.json]
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from benchmarks.cuda_timing import median_event_ms
from framework.layers.kernels.gated_delta_rule import DeltaRuleInputs, gated_delta_rule_varlen_triton
from framework.layers.kernels.gated_delta_rule_chunk import chunk_gated_delta_rule_varlen_triton

SHAPES = [(1, 8192), (1, 2048), (4, 2048), (16, 512), (64, 128), (256, 16)]  # (rows, tokens per row)
SWEEP = [(128, 8), (32, 8), (32, 4), (16, 4), (64, 4), (64, 8)]  # (block_v, num_warps); the first: the default


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    return median_event_ms(fn, reps)


def _inputs(rows: int, per_row: int, hk: int, h: int, d: int) -> tuple[DeltaRuleInputs, torch.Tensor, torch.Tensor]:
    t, dev = rows * per_row, "cuda"
    inp = DeltaRuleInputs(
        q=torch.randn(t, hk, d, device=dev, dtype=torch.bfloat16),
        k=torch.randn(t, hk, d, device=dev, dtype=torch.bfloat16),
        v=torch.randn(t, h, d, device=dev, dtype=torch.bfloat16),
        g=-torch.rand(t, h, device=dev) * 0.1,
        beta=torch.rand(t, h, device=dev),
    )
    qsl = torch.arange(0, t + 1, per_row, device=dev, dtype=torch.int32)
    return inp, torch.arange(rows, device=dev, dtype=torch.int32), qsl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gdn_prefill.json")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--heads", type=int, nargs=2, default=(16, 32), help="key heads, value heads")
    args = parser.parse_args()
    hk, h, d = args.heads[0], args.heads[1], 128
    results = []
    print(f"{'rows x len':>12} {'recurrent ms':>13} {'chunk ms':>9} {'speed-up':>9} {'chunk Mtok/s':>13}  sweep ms")
    for rows, per_row in SHAPES:
        inp, idx, qsl = _inputs(rows, per_row, hk, h, d)
        state = torch.zeros(rows, h, d, d, device="cuda")
        rec = _median_ms(lambda: gated_delta_rule_varlen_triton(inp, state, idx, qsl), args.reps)
        sweep = {
            f"bv{bv}_w{w}": _median_ms(
                lambda bv=bv, w=w: chunk_gated_delta_rule_varlen_triton(*inp, state, idx, qsl, block_v=bv, num_warps=w),
                args.reps,
            )
            for bv, w in SWEEP
        }
        chunk = next(iter(sweep.values()))
        tokens = rows * per_row
        row = {"rows": rows, "per_row": per_row, "recurrent_ms": rec, "chunk_ms": chunk, "sweep_ms": sweep}
        results.append(row)
        swept = " ".join(f"{k}={v:.3f}" for k, v in sweep.items())
        print(
            f"{rows:>5} x {per_row:<5} {rec:>13.3f} {chunk:>9.3f} {rec / chunk:>8.2f}x "
            f"{tokens / chunk / 1e3:>13.2f}  {swept}"
        )
    device = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump({"device": device, "heads": [hk, h], "head_dim": d, "results": results}, f, indent=1)
    print(f"{device}; wrote {args.out}")


if __name__ == "__main__":
    main()
