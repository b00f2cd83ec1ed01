"""Measure the fused MoE kernels' tiles per token count on this GPU and write the table `moe_launch_config` reads.

For each expert geometry (default Qwen3-30B-A3B: 128 experts, top-8, H 2048, I 768) and token count M (random
softmax top-k routing), every candidate tile set of `moe_tuning.candidates` is timed for the gate/up kernel and
for the down kernel apart (CUDA events around a CUDA graph of back-to-back launches: no host gaps), candidates
that fail to compile or exceed shared memory are skipped, and the winner (`moe_tuning.pick_winner`) is checked
against the heuristic's output. The candidates compile first in `--jobs` processes (Triton's disk cache serves the
timing process). Writes under `--out`:

- `<GPU>.json`: the table (the shipped one for this GPU, if any, with the tuned entries replacing its own); copy it
  to `framework/layers/kernels/moe_configs/` and commit it.
- `sweep_<geometry>.json`: every measurement and, per M, the default's and the winner's times and GB/s.
- `<geometry>_gbps.png`: best GB/s per M against the default's (with matplotlib).

    PYTHONPATH=$PWD python3 benchmarks/moe/tune_moe_tiles.py --out moe_tune [--quick] [--geometry gpt-oss-20b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (run as a script)

from benchmarks.moe.moe_tuning import (  # noqa: E402
    FULL_GRID,
    GEOMETRIES,
    H100_SHARED_MEMORY,
    KERNELS,
    QUICK_GRID,
    QUICK_TOKENS,
    TOKENS,
    Geometry,
    Grid,
    Measurement,
    candidates,
    measure,
    moved_bytes,
    pick_winner,
)
from framework.layers.kernels.fused_moe import (  # noqa: E402
    NO_QUANT,
    launch_moe_down,
    launch_moe_gate_up,
    launch_moe_kernels,
    route_moe_rows,
)
from framework.layers.kernels.moe_launch import (  # noqa: E402
    CONFIG_DIR,
    DeviceTable,
    MoeLaunchConfig,
    device_table_json,
    heuristic_launch_config,
    load_device_table,
    table_file_name,
)

Timer = Callable[[Callable[[], object], str, MoeLaunchConfig], float]  # (launch, kernel, tiles) -> ms


class KernelBench:
    """One geometry's experts and one token count's routed activations: each kernel's launch under given tiles."""

    def __init__(self, geometry: Geometry, dtype: torch.dtype, device: str, seed: int = 0) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        e, h, i = geometry.experts, geometry.hidden, geometry.intermediate
        self.geometry, self.device = geometry, device
        self.gate_up = (torch.randn(e, 2, i, h, generator=g, device=device) * h**-0.5).to(dtype)
        self.down = (torch.randn(e, h, i, generator=g, device=device) * i**-0.5).to(dtype)
        self.generator = g

    def route(self, tokens: int) -> None:
        """New activations and routing for `tokens` tokens (softmax top-k of random logits)."""
        geo, g = self.geometry, self.generator
        self.x = torch.randn(tokens, geo.hidden, generator=g, device=self.device).to(self.gate_up.dtype)
        logits = torch.randn(tokens, geo.experts, generator=g, device=self.device)
        self.weights, self.ids = torch.softmax(logits, -1).topk(geo.top_k, dim=-1)
        self.experts_touched = int(self.ids.unique().numel())
        self.routes: dict[int, object] = {}
        heuristic = heuristic_launch_config(tokens * geo.top_k, geo.experts)
        self.act = launch_moe_gate_up(self.x, self.gate_up, self._routing(heuristic), heuristic, NO_QUANT)

    def _routing(self, cfg: MoeLaunchConfig):  # type: ignore[no-untyped-def]
        if cfg.block_m not in self.routes:
            self.routes[cfg.block_m] = route_moe_rows(self.x, self.weights, self.ids, self.geometry.experts, cfg)
        return self.routes[cfg.block_m]

    def launch(self, kernel: str, cfg: MoeLaunchConfig) -> Callable[[], object]:
        """A call of one kernel under `cfg` (the routing, per block_m, is made once outside it)."""
        routing = self._routing(cfg)
        if kernel == "gate_up":
            return lambda: launch_moe_gate_up(self.x, self.gate_up, routing, cfg, NO_QUANT)
        return lambda: launch_moe_down(self.act, self.down, routing, cfg, NO_QUANT)

    def output(self, cfg: MoeLaunchConfig) -> torch.Tensor:
        """[M, H] the whole MoE MLP under `cfg` (the winner's check)."""
        return launch_moe_kernels(self.x, self.gate_up, self.down, self.weights, self.ids, cfg, NO_QUANT, NO_QUANT)


def tune_geometry(
    bench: KernelBench,
    token_counts: tuple[int, ...],
    grid: Grid,
    timer: Timer,
    shared_memory: int,
    deadline: float = float("inf"),
    log: Callable[[str], None] = print,
    save: Callable[[dict[int, MoeLaunchConfig], list[dict], list[Measurement]], None] = lambda *results: None,
) -> tuple[dict[int, MoeLaunchConfig], list[dict], list[Measurement]]:
    """(winner per token count, a summary row per token count, every measurement) of one geometry, also passed to
    `save` after each token count (a run stopped at its time limit keeps what it measured); token counts after
    `deadline` (time.monotonic) are left out, with a note in the log."""
    geo, element = bench.geometry, bench.gate_up.element_size()
    winners: dict[int, MoeLaunchConfig] = {}
    rows: list[dict] = []
    measurements: list[Measurement] = []
    last_s = 0.0
    for tokens in token_counts:
        began = time.monotonic()
        if began + 1.5 * last_s > deadline:  # each token count takes longer than the one before
            log(f"  time budget spent: token counts from {tokens} on are not tuned")
            break
        bench.route(tokens)
        found: list[Measurement] = []
        for kernel in KERNELS:
            configs = candidates(kernel, tokens, geo, grid, element, shared_memory)
            found += measure(kernel, tokens, configs, lambda cfg: timer(bench.launch(kernel, cfg), kernel, cfg))
        measurements.extend(found)
        try:
            winner, best_ms = pick_winner(found)
        except ValueError as exc:
            log(f"{tokens:>6} no winner: {exc} ({[m.error for m in found][:2]})")
            continue
        default = heuristic_launch_config(tokens * geo.top_k, geo.experts)
        default_ms = sum(m.ms for m in found if m.cfg == default and m.ms is not None)
        _check_winner(bench, winner, default, tokens)
        moved = sum(moved_bytes(geo, tokens, bench.experts_touched, element).values())
        row = {
            "tokens": tokens,
            "default_us": 1e3 * default_ms,
            "best_us": 1e3 * best_ms,
            "default_gbps": moved / default_ms / 1e6 if default_ms else None,
            "best_gbps": moved / best_ms / 1e6,
            "skipped": sum(m.ms is None for m in found),
            "timed": sum(m.ms is not None for m in found),
            "gate_up": list(winner[:5]),
            "down": list(winner.down_config()[:5]),
        }
        log(_format_row(row))
        winners[tokens] = winner
        rows.append(row)
        save(winners, rows, measurements)
        last_s = time.monotonic() - began
    return winners, rows, measurements


def _check_winner(bench: KernelBench, winner: MoeLaunchConfig, default: MoeLaunchConfig, tokens: int) -> None:
    """The winner computes what the heuristic's tiles compute, up to the summation order of its block_k (in 16-bit
    a tipped rounding of gate/up propagates: tests/gpu/test_fused_moe_gpu.py's bounds, 1% RMS, 1/8 RMS at most)."""
    out, ref = bench.output(winner).float(), bench.output(default).float()
    scale = ref.pow(2).mean().sqrt().item() or 1.0
    rms, worst = (out - ref).pow(2).mean().sqrt().item() / scale, (out - ref).abs().max().item() / scale
    if rms > 0.01 or worst > 0.125:
        raise RuntimeError(
            f"tokens {tokens}: the winner {winner} differs from the heuristic: {rms:.3g} RMS, {worst:.3g}"
        )


HEADER = f"{'M':>6} {'default us':>11} {'best us':>9} {'speedup':>8} {'default GB/s':>13} {'best GB/s':>10}  winner"


def _format_row(row: dict) -> str:
    speedup = row["default_us"] / row["best_us"] if row["default_us"] else float("nan")
    default_gbps = f"{row['default_gbps']:13.0f}" if row["default_gbps"] else f"{'-':>13}"
    return (
        f"{row['tokens']:>6} {row['default_us']:11.1f} {row['best_us']:9.1f} {speedup:7.2f}x {default_gbps} "
        f"{row['best_gbps']:10.0f}  gate_up {tuple(row['gate_up'])} down {tuple(row['down'])}"
    )


def precompile(argv: list[str], jobs: int) -> None:
    """Compile every candidate in `jobs` processes into Triton's disk cache: this script again with
    `--compile-shard i/jobs` (plain processes and arguments; failures are left to the timing, which skips them)."""
    if jobs <= 1:
        return
    shards = [[sys.executable, __file__, *argv, "--compile-shard", f"{i}/{jobs}"] for i in range(jobs)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for cmd in shards]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            print(f"  a compile process failed (the timing compiles its share): {err[-300:]}", flush=True)


def compile_shard(geometry: Geometry, dtype: torch.dtype, work: list[tuple[str, MoeLaunchConfig]], shard: str) -> None:
    """Launch every `index`-th of `work` once (`shard` = "index/count") on a few experts and one token: the kernels
    specialise on H, I, top_k and the dtype, not on E or M, so this compiles the variants the timing launches."""
    index, count = (int(part) for part in shard.split("/"))
    small = Geometry(geometry.name, geometry.top_k, geometry.top_k, geometry.hidden, geometry.intermediate)
    bench = KernelBench(small, dtype, "cuda")
    bench.route(1)
    for kernel, cfg in work[index::count]:
        try:
            bench.launch(kernel, cfg)()
            torch.cuda.synchronize()
        except Exception:  # the timing process meets (and reports) the same failure
            continue


def write_outputs(
    out: Path, device_name: str, table: DeviceTable, geometry: Geometry, rows: list, found: list, plot: bool = True
) -> None:
    """The table, the sweep and (`plot`) the plot of one geometry (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / table_file_name(device_name)).write_text(json.dumps(device_table_json(device_name, table), indent=1))
    sweep = {"device_name": device_name, "geometry": vars(geometry), "summary": rows}
    sweep["measurements"] = [m.to_json() for m in found]
    (out / f"sweep_{geometry.name}.json").write_text(json.dumps(sweep, indent=1))
    if not plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    tokens = [row["tokens"] for row in rows]
    ax.plot(tokens, [row["best_gbps"] for row in rows], "o-", label="tuned")
    ax.plot(tokens, [row["default_gbps"] or float("nan") for row in rows], "s--", label="heuristic")
    ax.set(xscale="log", xlabel="tokens M", ylabel="GB/s (gate/up + down)", title=f"{geometry.name} on {device_name}")
    ax.legend()
    fig.savefig(out / f"{geometry.name}_gbps.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    from benchmarks.cuda_timing import graph_event_ms

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", action="append", choices=sorted(GEOMETRIES), help="default qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", help=f"token counts (default {TOKENS})")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help=f"a smaller grid and tokens {QUICK_TOKENS} (~3 min)")
    parser.add_argument("--out", type=Path, default=Path("moe_tune"))
    parser.add_argument("--table", type=Path, help="the table to extend (default: the shipped one for this GPU)")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--budget-s", type=float, default=540.0, help="start no token count that would end later")
    parser.add_argument("--compile-shard", help=argparse.SUPPRESS)  # i/n: a `precompile` process
    args = parser.parse_args(argv)
    geometries = args.geometry or ["qwen3-30b-a3b"]
    start = time.monotonic()
    device_name = torch.cuda.get_device_name()
    dtype = getattr(torch, args.dtype)
    grid = QUICK_GRID if args.quick else FULL_GRID
    token_counts = tuple(args.tokens or (QUICK_TOKENS if args.quick else TOKENS))
    shared = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", H100_SHARED_MEMORY)
    table_path = args.table or CONFIG_DIR / table_file_name(device_name)
    table = dict(load_device_table(str(table_path), device_name))
    timer: Timer = lambda launch, kernel, cfg: graph_event_ms(launch)
    for name in geometries:
        geo = GEOMETRIES[name]
        element = torch.empty((), dtype=dtype).element_size()
        work = sorted(
            {(k, c) for t in token_counts for k in KERNELS for c in candidates(k, t, geo, grid, element, shared)}
        )
        if args.compile_shard:
            compile_shard(geo, dtype, work, args.compile_shard)
            continue
        print(f"{name} on {device_name} ({args.dtype}, shared memory {shared} B): tokens {token_counts}", flush=True)
        forwarded = ["--geometry", name, "--dtype", args.dtype, *(["--quick"] if args.quick else [])]
        precompile([*forwarded, "--tokens", *map(str, token_counts)], args.jobs)
        print(f"  {len(work)} kernel variants compiled in {time.monotonic() - start:.0f} s\n{HEADER}", flush=True)
        bench = KernelBench(geo, dtype, "cuda")
        key = (args.dtype, geo.experts, geo.intermediate, geo.hidden, geo.top_k)
        shipped = table.get(key, {})

        def save(winners: dict, rows: list, found: list, plot: bool = False) -> None:
            table[key] = {**shipped, **winners}
            write_outputs(args.out, device_name, table, geo, rows, found, plot)

        results = tune_geometry(bench, token_counts, grid, timer, shared, start + args.budget_s, save=save)
        if results[0]:
            save(*results, plot=True)
        del bench
        torch.cuda.empty_cache()
    if not args.compile_shard:
        written = args.out / table_file_name(device_name)
        print(f"wrote {written} in {time.monotonic() - start:.0f} s: copy it to {CONFIG_DIR} and commit it")


if __name__ == "__main__":
    main()
