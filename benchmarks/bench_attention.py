"""Benchmark the Triton paged attention on a CUDA GPU: decode time and achieved KV bandwidth, plus prefill.

Geometry of Qwen3-0.6B (16 query heads, 8 KV heads, head_dim 128, bfloat16, KV blocks of 16 tokens in
shuffled physical order). For each decode batch x sequence length it times, with `triton.testing.do_bench`
(median, L2 flushed between runs):

* `triton`: `paged_attention` as the engine calls it (split-KV rule on),
* `triton_1split`: the same kernel forced to one split (what the rule saves),
* `sdpa`: `torch.nn.functional.scaled_dot_product_attention` on the same keys laid out densely
  (`[B, heads, S, D]`, GQA native when the installed torch supports it), or flash-attn if importable.

`--compare-reduce` times instead the split-KV decode with its reduce fused into the attention launch (the
default) against the two-launch path (`fused_reduce=False`) at batch 1/4/16 x 1024..4096 keys: 28
back-to-back calls (one per layer of a Qwen3-0.6B step) in one CUDA graph, per call and saved per step;
then the shape-dependent decode tiles against the fixed 128/4/2 ones at nano's unsplit shapes; writes
`attention_reduce.json` and `attention_reduce.png`.

Achieved bandwidth = bytes of K and V that must be read (2 x sum(seq_lens) x kv_heads x head_dim x 2 B) /
time. Prefill cases report TFLOP/s (4 x heads x head_dim x visible query-key pairs / time).
Prints a table; writes `attention_bench.json` and `attention_bench.png` into the directory given.

    PYTHONPATH=$PWD python benchmarks/bench_attention.py OUT_DIR [--batches 1 16 64 256 512]
        [--seq-lens 512 1024 2048 4096]
    PYTHONPATH=$PWD python benchmarks/bench_attention.py OUT_DIR --compare-reduce
    PYTHONPATH=$PWD python benchmarks/bench_attention.py OUT_DIR --sweep-mixed   # tiles at nano's draining batches
    PYTHONPATH=$PWD python benchmarks/bench_attention.py OUT_DIR --sweep-kv-dtype   # bf16 vs FP8 caches

The modules are in `benchmarks/attention/`: `cases` (geometry, batches), `timing`, `default` (the tables above),
`sweeps`, `reduce`, `mixed` (`--row-order`, `--sweep-mixed`), `kv_dtype`, `plots`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (framework); this folder is [0]

from attention.cases import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS  # noqa: E402
from attention.default import decode_and_prefill  # noqa: E402
from attention.kv_dtype import sweep_kv_dtype  # noqa: E402
from attention.mixed import compare_row_order, sweep_mixed  # noqa: E402
from attention.plots import plot_decode  # noqa: E402
from attention.reduce import compare_reduce  # noqa: E402
from attention.sweeps import (  # noqa: E402
    NANO_SWEEP_CONFIGS,
    NANO_SWEEP_SHAPES,
    SMALL_SWEEP_CONFIGS,
    SMALL_SWEEP_SHAPES,
    SMALL_SWEEP_SPLITS,
    sweep,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--no-baseline", action="store_true", help="skip the dense SDPA/flash-attn baseline")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile configs and split counts")
    parser.add_argument(
        "--sweep-nano",
        action="store_true",
        help="sweep decode tiles at nano's shapes only (no prefill sweep, no default table)",
    )
    parser.add_argument(
        "--sweep-small",
        action="store_true",
        help="sweep tiles x split counts (up to 32, splits of >= 32 keys) at batch 1-8 decode shapes",
    )
    parser.add_argument(
        "--row-order", action="store_true", help="only compare launch orders of unsplit decode at nano's mixed lengths"
    )
    parser.add_argument(
        "--compare-reduce",
        action="store_true",
        help="only compare the fused split-KV reduce with the two-launch one (batch 1/4/16)",
    )
    parser.add_argument(
        "--sweep-kv-dtype",
        action="store_true",
        help="decode over bf16 and FP8 caches, products in bf16 or float16, a few tile configs",
    )
    parser.add_argument(
        "--sweep-mixed", action="store_true", help="only sweep decode tiles at nano's draining batches of mixed lengths"
    )
    parser.add_argument(
        "--heads",
        type=int,
        default=NUM_HEADS,
        help="--sweep-mixed: query heads (8 KV heads), 16 for Qwen3-0.6B, 32 for the Qwen3-8B geometry",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    dtype = getattr(torch, args.dtype)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    env = dict(
        gpu=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        dtype=args.dtype,
        heads=args.heads,
        kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
    )
    print(f"# {env}", file=sys.stderr)

    if args.compare_reduce:
        compare_reduce(dtype, args.out_dir, env)
        return 0
    if args.sweep_kv_dtype:
        sweep_kv_dtype(args.out_dir, env)
        return 0
    if args.sweep_mixed:
        sweep_mixed(dtype, args.out_dir, env, num_heads=args.heads)
        return 0
    if args.row_order:
        compare_row_order(dtype, args.out_dir, env)
        return 0
    if args.sweep_nano:
        results = sweep(dtype, NANO_SWEEP_SHAPES, NANO_SWEEP_CONFIGS, with_prefill=False)
        (args.out_dir / "attention_sweep_nano.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
        return 0
    if args.sweep_small:
        results = sweep(
            dtype,
            SMALL_SWEEP_SHAPES,
            SMALL_SWEEP_CONFIGS,
            with_prefill=False,
            split_counts=SMALL_SWEEP_SPLITS,
            min_split_keys=32,
        )
        (args.out_dir / "attention_sweep_small.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
        return 0
    results = sweep(dtype) if args.sweep else []
    results += decode_and_prefill(dtype, args.batches, args.seq_lens, with_baseline=not args.no_baseline)
    (args.out_dir / "attention_bench.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    plot_decode(results, args.out_dir / "attention_bench.png")
    print(f"# wrote {args.out_dir / 'attention_bench.json'} and attention_bench.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
