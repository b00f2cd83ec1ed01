"""Sweep the prefill attention variants on a CUDA GPU against the older large-row launch and SDPA.

Qwen3-0.6B geometry (16 query heads, 8 KV heads, head_dim 128, bf16, 16-token pages in shuffled order).
Shapes: the prefill batches of `experiment=prefix_bench` with caching off (8,192-token budget: four ~2,040-token
prompts from position 0 plus a 32-token start of the fifth; then that prompt's remaining 2,012 tokens after its
32 cached, three more prompts and 64 decode rows), a causal 8,192-token prefill and 2,048 tokens after 2,048
cached. Each variant runs through `paged_attention` as the engine calls it (`prefill_variant=` the variant,
parsed by `PrefillVariant.parse`; `paged` = `prefill_kernel=False`, the older `_paged_attention_kernel` launch), timed with
`triton.testing.do_bench` (median) on CUDA-graph replays. TFLOP/s = 4 x heads x head_dim x visible
query-key pairs of the prefill rows / time. `sdpa` is `scaled_dot_product_attention` (flash, causal) on the
same keys laid out densely, one call per prefill row, where a row has no cached prefix (else no equivalent).
Every variant's output is compared with the first variant's (max abs difference, reported).

    PYTHONPATH=$PWD python scripts/bench_prefill_attention.py OUT_DIR [--variants SPEC ...] [--shapes NAME ...]

Prints a table; writes `prefill_sweep.json` and `prefill_sweep.png` into OUT_DIR.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DECODE_ROWS = [(2100, 1)] * 64
SHAPES = {  # (cached context_len, query_len) per row
    "prefix_fresh": [(0, 2040), (0, 2031), (0, 2064), (0, 2025), (0, 32)],
    "prefix_continued": DECODE_ROWS + [(32, 2012), (0, 2050), (0, 2017), (0, 2044)],
    "causal_8192": [(0, 8192)],
    "2048_after_2048": [(2048, 2048)],
}
# "paged" = the older large-row launch; any other entry is a PrefillVariant spec over the default variant.
VARIANTS = [
    "paged",
    "",  # default: 128x128, 8 warps, 3 stages, reversed order, K gathered transposed, page ids prefetched
    "prefetch_pages=0",
    "reverse=0",
    "k_trans=0",
    "q_prescale=1",
    "heads=1",
    "num_stages=2",
    "block_n=64",
    "block_n=64,num_stages=4",
    "block_n=64,num_stages=5",
    "block_n=64,num_stages=4,k_trans=0,q_prescale=1",
    "block_m=64,block_n=64,num_warps=4,num_stages=4",
    "block_m=64,num_warps=4",
    "block_n=64,qk_ahead=1",
]


def _dense_rows(cache: torch.Tensor, meta, rows) -> list:
    """Per prefill row without cached prefix: q [1, H, Q, D] view and dense K/V [1, kvH, S, D]."""
    out = []
    starts = meta.query_start_loc.tolist()
    for r, (context_len, query_len) in enumerate(rows):
        if context_len or query_len <= 8:
            continue
        pos = torch.arange(query_len, device=cache.device)
        slots = meta.block_tables[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k = cache[0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(0, 1).unsqueeze(0).contiguous()
        v = cache[1].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(0, 1).unsqueeze(0).contiguous()
        out.append((starts[r], query_len, k, v))
    return out


def _time_graph_ms(fn) -> float:
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return float(do_bench(graph.replay, warmup=10, rep=60, return_mode="median"))


def bench_shape(name: str, variants: list[str], with_sdpa: bool) -> list[dict]:
    import torch.nn.functional as F

    from framework.layers.attention import triton_paged_attention as tpa
    from framework.layers.attention import triton_prefill_attention as tfa
    from framework.layers.attention.paged import store_kv_reference

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.attention_cases import make_paged_case

    rows = SHAPES[name]
    case = make_paged_case(
        rows,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        dtype=torch.bfloat16,
        device="cuda",
        poison=False,
    )
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    query, cache, meta, scale = case.query, case.kv_cache, case.meta, HEAD_DIM**-0.5
    pairs = sum(c * q + q * (q + 1) // 2 for c, q in rows if q > 8)  # prefill rows' visible (query, key) pairs
    flops = 4 * NUM_HEADS * HEAD_DIM * pairs
    results, base_out = [], None
    for spec in variants:
        base = tfa.default_variant(HEAD_DIM, on_gpu=True)
        choice = (
            dict(prefill_kernel=False)
            if spec == "paged"
            else dict(prefill_variant=tfa.PrefillVariant.parse(spec, base))
        )
        label = "paged (older launch)" if spec == "paged" else choice["prefill_variant"].label()
        t0 = time.perf_counter()
        try:
            out = tpa.paged_attention(query, cache, meta, scale, **choice)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            ms = _time_graph_ms(functools.partial(tpa.paged_attention, query, cache, meta, scale, **choice))
        except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: reported, the sweep goes on
            print(f"{name:>17} {label:<44} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
            results.append(dict(shape=name, variant=spec, label=label, error=f"{type(err).__name__}: {err}"[:300]))
            continue
        if base_out is None:
            base_out = out[: case.num_real_tokens].float()
        diff = float((out[: case.num_real_tokens].float() - base_out).abs().max())
        r = dict(
            shape=name,
            variant=spec,
            label=label,
            us=ms * 1e3,
            tflops=flops / (ms * 1e-3) / 1e12,
            max_abs_diff_vs_first=diff,
            first_call_s=compile_s,
        )
        results.append(r)
        print(f"{name:>17} {label:<44} {r['us']:9.1f} us {r['tflops']:7.1f} TFLOP/s  diff {diff:.2e}", flush=True)
    dense = _dense_rows(cache, meta, rows) if with_sdpa else []
    if dense and len(dense) == sum(1 for _, q in rows if q > 8):

        def sdpa():
            for start, q_len, k, v in dense:
                q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        ms = _time_graph_ms(sdpa)
        r = dict(
            shape=name, variant="sdpa", label="sdpa (dense, flash)", us=ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12
        )
        results.append(r)
        print(f"{name:>17} {r['label']:<44} {r['us']:9.1f} us {r['tflops']:7.1f} TFLOP/s", flush=True)
    return results  # the case's GPU tensors are freed with this frame


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "tflops" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in ok))
    labels = list(dict.fromkeys(r["label"] for r in ok))
    fig, ax = plt.subplots(figsize=(max(10, 1.2 * len(labels)), 5))
    width = 0.8 / max(1, len(shapes))
    for i, shape in enumerate(shapes):
        by_label = {r["label"]: r["tflops"] for r in ok if r["shape"] == shape}
        ax.bar(
            [j + i * width for j in range(len(labels))], [by_label.get(lab, 0.0) for lab in labels], width, label=shape
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (prefill rows' causal pairs)")
    ax.set_title("Prefill attention variants, H200 bf16, Qwen3-0.6B heads")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=VARIANTS,
        help="'paged' (older large-row launch) or PrefillVariant specs, e.g. 'block_n=64,num_stages=4'",
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--no-sdpa", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    args.out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    env = dict(
        gpu=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        heads=NUM_HEADS,
        kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
    )
    print(f"# {env}", file=sys.stderr)
    results = []
    for shape in args.shapes:
        results += bench_shape(shape, args.variants, with_sdpa=not args.no_sdpa)
        torch.cuda.empty_cache()
        (args.out_dir / "prefill_sweep.json").write_text(json.dumps(dict(env=env, results=results), indent=1))

    # Summary: TFLOP/s per variant (rows) and shape (columns); best variant per shape.
    ok = [r for r in results if "tflops" in r]
    labels = list(dict.fromkeys(r["label"] for r in ok))
    print(f"\n{'variant':<44}" + "".join(f"{s:>18}" for s in args.shapes))
    for label in labels:
        cells = {r["shape"]: r["tflops"] for r in ok if r["label"] == label}
        print(f"{label:<44}" + "".join(f"{cells[s]:>18.1f}" if s in cells else f"{'-':>18}" for s in args.shapes))
    for shape in args.shapes:
        mine = [r for r in ok if r["shape"] == shape and r["variant"] not in ("paged", "sdpa")]
        if mine:
            best = max(mine, key=lambda r: r["tflops"])
            base = next((r for r in ok if r["shape"] == shape and r["variant"] == "paged"), None)
            gain = f" ({best['tflops'] / base['tflops']:.2f}x the older launch)" if base else ""
            print(f"best at {shape}: {best['label']} {best['tflops']:.1f} TFLOP/s{gain}; spec '{best['variant']}'")
    _plot(results, args.out_dir / "prefill_sweep.png")
    (args.out_dir / "prefill_sweep.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    print(f"# wrote {args.out_dir / 'prefill_sweep.json'} and prefill_sweep.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
