"""LoRA shrink and expand kernels against the base bf16 GEMM of the same projection group, per launch variant.

For the Qwen3-0.6B and Qwen3-8B geometries' four projection groups (merged q/k/v, o, merged gate/up, down: one
shrink and one expand each, as `framework.models.lora.projection` runs them), token counts T from one decode row to
a prefill chunk, 1 and 8 rank-16 adapters (tokens' adapters round robin, as decode requests of 8 adapters): the
median time of the shrink (`x @ A^T`) and the expand (`y += xa @ B^T`) of each launch variant and their sum, next
to `F.linear` of the group's base weight. Each time is a CUDA graph of back-to-back launches replayed between CUDA
events (`graph_event_ms`): the engine replays decode graphs, so launch gaps of the host are not LoRA's cost.

Variants (`framework.layers.kernels.lora`): `row` (per token row, both kernels), `segment` (tiles of 32 rows per
adapter slot, both), `segment16` (16-row shrink tiles), `splitS` (the shrink's K cut into S ranges, the segment
expand summing the S partials), `split4/row` (the same partials into the per-row expand). Over the tokens grouped
by adapter (`framework.layers.kernels.lora_fused`, the layout built outside the timing as `LoraState` builds it
once per step): `fusedN` (shrink and expand in one launch, N-column tiles; its time in the shrink column, 0 in the
expand's), `fused256x4` (4 such tiles a program, every part's xa computed once for them) and `sorted` (the
unfused pair over the same layout, no slot dimension: against `fused` it isolates the
launch count, against `segment` the work the slot-masked kernels repeat per adapter). `default` marks the
variant the dispatch picks at that T. The last table sums the four groups: one decoder layer's LoRA cost per
variant and T against its four base GEMMs, the figure that sets `SPLIT_K_MAX_TOKENS` and `ROW_EXPAND_MAX_TOKENS`.
Prints the tables, writes `<out>.json` and `<out>.png`.

    PYTHONPATH=$PWD python benchmarks/lora/bench_lora_kernels.py [--out lora_kernels] [--tokens 64 256]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.nn import functional as F

from benchmarks.cuda_timing import graph_event_ms
from framework.layers.kernels import lora
from framework.layers.kernels.lora import LoraPartLayout, lora_expand_triton, lora_shrink_triton
from framework.layers.kernels.lora_fused import (
    lora_expand_sorted_triton,
    lora_segments_of,
    lora_shrink_expand_triton,
    lora_shrink_sorted_triton,
)
from framework.models.presets import PRESETS

RANK = 16
CUDA = torch.device("cuda")
TOKENS = (1, 8, 64, 128, 256, 512)
ADAPTERS = (1, 8)
GEOMETRIES = ("qwen3-0.6b", "qwen3-8b")
# name: (shrink variant, shrink keyword arguments, expand variant)
VARIANTS: dict[str, tuple[str, dict[str, int], str]] = {
    "row": ("row", {}, "row"),
    "segment": ("segment", {}, "segment"),
    "segment16": ("segment", {"block_m": 16}, "segment"),
    "split2": ("split", {"splits": 2}, "segment"),
    "split4": ("split", {"splits": 4}, "segment"),
    "split8": ("split", {"splits": 8}, "segment"),
    "split16": ("split", {"splits": 16}, "segment"),
    "split4/row": ("split", {"splits": 4}, "row"),
}
# name: (column tile width, column tiles a program) of the fused launch, or (0, 0) for the unfused sorted pair
GROUPED_VARIANTS: dict[str, tuple[int, int]] = {
    "fused128": (128, 1),
    "fused256": (256, 1),
    "fused512": (512, 1),
    "fused256x4": (256, 4),
    "sorted": (0, 0),
}
NAMES = (*VARIANTS, *GROUPED_VARIANTS)


def projection_groups(geometry: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """group -> (input features K, each part's output features), as `attach_lora` forms them."""
    cfg = PRESETS[geometry]
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        "qkv": (hidden, (q, kv, kv)),
        "o": (q, (hidden,)),
        "gate_up": (hidden, (inter, inter)),
        "down": (inter, (hidden,)),
    }


def default_variant(num_tokens: int, k: int) -> str:
    """The VARIANTS name the dispatch runs at this size (its shrink plan and the expand's token rule)."""
    shrink, splits = lora.shrink_plan(num_tokens, k)
    if shrink != "split":
        return shrink
    expand = "row" if num_tokens <= lora.ROW_EXPAND_MAX_TOKENS else "segment"
    name = f"split{splits}" + ("/row" if expand == "row" else "")
    return name if name in VARIANTS else "?"


def _time(fn: Callable[[], object]) -> float:
    return graph_event_ms(fn, reps=10, target_ms=1.0)


def bench_group(
    k: int,
    outs: tuple[int, ...],
    num_tokens: int,
    adapters: int,
    device: torch.device = CUDA,
    time: Callable[[Callable[[], object]], float] = _time,
) -> dict[str, Any]:
    """Base GEMM and every variant's shrink and expand at one shape (times in ms, by `time`)."""
    dtype = torch.bfloat16
    parts, n = len(outs), sum(outs)
    x = torch.randn(num_tokens, k, device=device, dtype=dtype)
    weight = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
    lora_a = torch.randn(adapters, parts * RANK, k, device=device, dtype=dtype) * k**-0.5
    lora_b = torch.randn(adapters, n, RANK, device=device, dtype=dtype) * 0.01
    token_lora = (torch.arange(num_tokens, device=device) % adapters).to(torch.int32)
    layout = LoraPartLayout([sum(outs[:i]) for i in range(parts + 1)], device) if parts > 1 else None
    y = torch.randn(num_tokens, n, device=device, dtype=dtype)
    result: dict[str, Any] = {"base_ms": time(lambda: F.linear(x, weight)), "variants": {}}
    for name, (shrink, kwargs, expand) in VARIANTS.items():
        xa = lora_shrink_triton(x, lora_a, token_lora, variant=shrink, **kwargs)
        t_shrink = time(lambda: lora_shrink_triton(x, lora_a, token_lora, variant=shrink, **kwargs))  # noqa: B023
        t_expand = time(lambda: lora_expand_triton(y, xa, lora_b, token_lora, layout, variant=expand))  # noqa: B023
        splits = xa.shape[0] if xa.dim() == 3 else 1
        result["variants"][name] = _entry(t_shrink, t_expand, result["base_ms"], splits)
    rows, bounds = lora_segments_of(token_lora, adapters)
    for name, (block_n, tiles) in GROUPED_VARIANTS.items():
        if block_n:
            fused = partial(
                lora_shrink_expand_triton, y, x, lora_a, lora_b, rows, bounds, layout, block_n=block_n,
                tiles_per_program=tiles,
            )  # fmt: skip
            fused()  # compile (and build the layout's tile table for this width) before the graph capture
            result["variants"][name] = _entry(time(fused), 0.0, result["base_ms"], 1)
            continue
        xa = lora_shrink_sorted_triton(x, lora_a, rows, bounds, RANK)
        t_shrink = time(lambda: lora_shrink_sorted_triton(x, lora_a, rows, bounds, RANK))  # noqa: B023
        t_expand = time(lambda: lora_expand_sorted_triton(y, xa, lora_b, rows, bounds, layout))  # noqa: B023
        result["variants"][name] = _entry(t_shrink, t_expand, result["base_ms"], 1)
    return result


def _entry(t_shrink: float, t_expand: float, base_ms: float, splits: int) -> dict[str, Any]:
    lora_ms = t_shrink + t_expand
    return {
        "shrink_ms": t_shrink,
        "expand_ms": t_expand,
        "lora_ms": lora_ms,
        "vs_base": lora_ms / base_ms,
        "splits": splits,
    }


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (g, a) for g in dict.fromkeys(r["geometry"] for r in rows) for a in dict.fromkeys(r["adapters"] for r in rows)
    ]
    groups = list(dict.fromkeys(r["group"] for r in rows))
    fig, axes = plt.subplots(len(panels), len(groups), figsize=(4 * len(groups), 3 * len(panels)), squeeze=False)
    for i, (geometry, adapters) in enumerate(panels):
        for j, group in enumerate(groups):
            ax = axes[i][j]
            mine = [r for r in rows if (r["geometry"], r["adapters"], r["group"]) == (geometry, adapters, group)]
            tokens = [r["tokens"] for r in mine]
            ax.plot(tokens, [r["base_ms"] * 1e3 for r in mine], "k--", label="base GEMM")
            for name in NAMES:
                ax.plot(tokens, [r["variants"][name]["lora_ms"] * 1e3 for r in mine], marker=".", label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{geometry} {group}, {adapters} adapter(s)", fontsize=9)
            ax.set_xlabel("tokens")
            ax.set_ylabel("us (shrink + expand)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _layer_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per geometry, adapter count and T: the four groups' base and LoRA times summed (one decoder layer)."""
    layers: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["geometry"], r["adapters"], r["tokens"])
        layer = layers.setdefault(key, {"base_ms": 0.0, "variants": dict.fromkeys(NAMES, 0.0), "default": "?"})
        layer["base_ms"] += r["base_ms"]
        for name in NAMES:
            layer["variants"][name] += r["variants"][name]["lora_ms"]
        if r["group"] == "qkv":
            layer["default"] = r["default"]
    out = []
    for (geometry, adapters, tokens), layer in layers.items():
        best = min(layer["variants"], key=layer["variants"].get)
        out.append({"geometry": geometry, "adapters": adapters, "tokens": tokens, **layer, "best": best})
    return out


def _print_layers(layers: list[dict[str, Any]]) -> None:
    print("One decoder layer (the four groups): LoRA us per variant (* = default), base GEMMs us, best, best / base")
    print(f"{'geometry':11} {'T':>4} {'L':>2} {'base us':>8} " + " ".join(f"{n:>10}" for n in NAMES) + "  best")
    for layer in layers:
        cells = " ".join(f"{t * 1e3:9.1f}{'*' if n == layer['default'] else ' '}" for n, t in layer["variants"].items())
        best = layer["variants"][layer["best"]] / layer["base_ms"]
        print(
            f"{layer['geometry']:11} {layer['tokens']:4d} {layer['adapters']:2d} {layer['base_ms'] * 1e3:8.1f} "
            f"{cells}  {layer['best']} {best:.2f}"
        )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="lora_kernels", help="writes <out>.json and <out>.png")
    parser.add_argument("--geometry", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--adapters", nargs="+", type=int, default=list(ADAPTERS))
    args = parser.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # before the runs: their results must have a place
    if not torch.cuda.is_available():
        print("bench_lora_kernels needs a CUDA GPU (none found): nothing measured", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, rank {RANK}; us per launch pair (shrink+expand), * = dispatch default")
    head = " ".join(f"{name:>13}" for name in NAMES)
    print(f"{'geometry':11} {'group':8} {'K':>5} {'N':>6} {'T':>4} {'L':>2} {'base us':>8} {head}")
    rows = []
    for geometry in args.geometry:
        for group, (k, outs) in projection_groups(geometry).items():
            for tokens in args.tokens:
                for adapters in args.adapters:
                    timed = bench_group(k, outs, tokens, adapters)
                    row = {"geometry": geometry, "group": group, "K": k, "N": sum(outs), "parts": len(outs)}
                    row.update(tokens=tokens, adapters=adapters, default=default_variant(tokens, k), **timed)
                    rows.append(row)
                    cells = " ".join(
                        f"{v['shrink_ms'] * 1e3:5.1f}+{v['expand_ms'] * 1e3:5.1f}{'*' if n == row['default'] else ' '}"
                        for n, v in timed["variants"].items()
                    )
                    print(
                        f"{geometry:11} {group:8} {k:5d} {sum(outs):6d} {tokens:4d} {adapters:2d} "
                        f"{timed['base_ms'] * 1e3:8.1f} {cells}",
                        flush=True,
                    )
    layers = _layer_table(rows)
    with open(f"{args.out}.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rank": RANK, "rows": rows, "layers": layers}, f, indent=1)
    _plot(rows, f"{args.out}.png")
    print(f"wrote {args.out}.json, {args.out}.png")
    _print_layers(layers)  # last: the log's tail is this table
    return 0


if __name__ == "__main__":
    sys.exit(main())
