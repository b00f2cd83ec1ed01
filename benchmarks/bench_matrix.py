"""Paired rounds of `mrv2 bench` over named configurations and workloads: which fast path pays, and by how much.

Each round runs every (workload, configuration) once, one process per run, in an order rotated from round to
round (so no configuration always runs first or last), each run bracketed by the host-speed probe
(`benchmarks/host_speed.py`: the H200 machine's host switches between a fast and a half-speed state). The table
gives every run's output tok/s with its probe, the median over rounds, and each configuration's median ratio to
the first one *within* a round (the runs of a round are back to back: the paired comparison).

    python3 benchmarks/bench_matrix.py --out $OUT/matrix --rounds 3 \\
        --config default= --config full_step=runner.full_step_cuda_graphs=true \\
        --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0"

A configuration or workload is NAME=OVERRIDES (space-separated Hydra overrides, possibly none). A configuration
named NAME@DIR runs from the source tree DIR instead (its working directory and first on PYTHONPATH): another
commit's code, e.g. `git archive BASE | tar -x -C DIR`, paired with today's (`--config base@/tmp/base=`).
Writes matrix.json and matrix.png into --out, and each run's own bench.json under --out/runs/.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_speed import host_probe_us, median  # noqa: E402


def _named(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=OVERRIDES, got {text!r}")
    return name, shlex.split(overrides)


def run_once(
    workload: list[str], config: list[str], out_dir: Path, timeout_s: float, tree: Path | None = None
) -> dict[str, Any]:
    """One `mrv2 bench` process (from source tree `tree`, else this one); its output tok/s (None if it failed)
    and the host probe around it."""
    before = host_probe_us()
    cmd = [
        sys.executable,
        "-m",
        "framework.entrypoints.cli",
        "bench",
        *workload,
        *config,
        f"bench.output_dir={out_dir.resolve()}",
    ]
    env = (
        None
        if tree is None
        else {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(tree.resolve())] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            ),
        }
    )
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tree, env=env)
        ok, tail = proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        ok, tail = False, f"timed out after {timeout_s:.0f} s"
    wall = time.monotonic() - start
    probe = max(before, host_probe_us())
    tok_s = None
    if ok and (out_dir / "bench.json").exists():
        results = json.loads((out_dir / "bench.json").read_text())["results"]
        tok_s = next((r["output_tok_per_s"] for r in results if r["engine"].startswith("mrv2")), None)
    return {
        "output_tok_per_s": tok_s,
        "host_probe_us": probe,
        "wall_s": round(wall, 1),
        **({} if tok_s is not None else {"error": tail}),
    }


def run_matrix(
    configs: list[tuple[str, list[str]]],
    workloads: list[tuple[str, list[str]]],
    rounds: int,
    out: Path,
    timeout_s: float,
) -> dict[str, Any]:
    """{workload: {config: [run per round]}}, every round over all pairs in a rotated order."""
    runs: dict[str, dict[str, list]] = {w: {c: [] for c, _ in configs} for w, _ in workloads}
    pairs = [(w, wo, c, co) for w, wo in workloads for c, co in configs]
    for r in range(rounds):
        shift = r % len(pairs)
        for w, wo, c, co in pairs[shift:] + pairs[:shift]:
            name, _, tree = c.partition("@")
            result = run_once(wo, co, out / "runs" / f"{w}-{name}-r{r + 1}", timeout_s, Path(tree) if tree else None)
            runs[w][c].append(result)
            print(
                f"round {r + 1} {w:12s} {c:14s} {_tok_s(result['output_tok_per_s'])} tok/s "
                f"(probe {result['host_probe_us']} us, {result['wall_s']} s)",
                flush=True,
            )
    return runs


def summarise(runs: dict[str, dict[str, list]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload and configuration: median tok/s, and the median within-round ratio to the first config."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for w, by_config in runs.items():
        first = next(iter(by_config.values()))
        table[w] = {}
        for c, rs in by_config.items():
            values = [x["output_tok_per_s"] for x in rs if x["output_tok_per_s"] is not None]
            ratios = [
                x["output_tok_per_s"] / f["output_tok_per_s"]
                for x, f in zip(rs, first)
                if x["output_tok_per_s"] and f["output_tok_per_s"]
            ]
            table[w][c] = {
                "median_tok_per_s": median(values),
                "median_paired_ratio": median(ratios),
                "runs": len(rs),
                "failed": len(rs) - len(values),
            }
    return table


def _print_table(runs: dict[str, dict[str, list]], table: dict[str, dict[str, dict[str, Any]]]) -> None:
    print("\n| workload | config | runs: out tok/s (host probe us) | median | paired ratio to first |")
    print("|---|---|---|---|---|")
    for w, by_config in runs.items():
        for c, rs in by_config.items():
            cells = ", ".join(f"{_tok_s(x['output_tok_per_s'])} ({x['host_probe_us']:.0f})" for x in rs)
            s = table[w][c]
            ratio = f"{s['median_paired_ratio']:.3f}" if s["median_paired_ratio"] is not None else "-"
            print(f"| {w} | {c} | {cells} | {_tok_s(s['median_tok_per_s'])} | {ratio} |")


def _tok_s(value: Any) -> str:
    return f"{value:,.0f}" if value is not None else "FAILED"


def _plot(table: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(4.5 * len(table), 3.5), squeeze=False)
    for ax, (w, by_config) in zip(axes[0], table.items()):
        ax.bar(list(by_config), [s["median_tok_per_s"] or 0 for s in by_config.values()])
        ax.set_title(w)
        ax.set_ylabel("median output tok/s")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=_named, action="append", required=True, help="NAME=OVERRIDES")
    parser.add_argument("--workload", type=_named, action="append", required=True, help="NAME=OVERRIDES")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("bench_results/matrix"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = run_matrix(args.config, args.workload, args.rounds, args.out, args.timeout)
    table = summarise(runs)
    _print_table(runs, table)
    (args.out / "matrix.json").write_text(
        json.dumps(
            {"configs": dict(args.config), "workloads": dict(args.workload), "runs": runs, "summary": table}, indent=2
        )
    )
    _plot(table, args.out / "matrix.png")
    failed = sum(s["failed"] for by_config in table.values() for s in by_config.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
