"""Tensor / pipeline parallel scaling on the "nano" workload: TP=1 vs TP=2/TP=4 and PP=2, Qwen3-0.6B and Qwen3-8B.

Each case is one `mrv2 bench experiment=nano ...` in its own process (fresh GPUs, fresh process group); this
script collects their `bench.json`, prints a table of output / total tokens per second with the scaling against
TP=1 of the same model, and writes `parallel.json` and `parallel.png` into `--out`.

    python3 benchmarks/bench_parallel.py --out bench_results/parallel            # needs 2 GPUs, 5-7 minutes
    python3 benchmarks/bench_parallel.py --out /tmp/pp --cases 0.6b-pp2 8b-pp2 --num-requests-pp 64
    python3 benchmarks/bench_parallel.py --out /tmp/p --cases 0.6b-tp1 --num-requests 8 --device cpu  # smoke

Random bf16 weights (model presets `qwen3-0.6b`, `qwen3-8b`); no HF baseline, no idle probe.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]


class Case(NamedTuple):
    name: str
    preset: str
    tp: int
    pp: int


CASES = [  # the default run: the 2-GPU cases; PP=2 last, it is the one to drop when time is short
    Case("0.6b-tp1", "qwen3-0.6b", 1, 1),
    Case("0.6b-tp2", "qwen3-0.6b", 2, 1),
    Case("8b-tp1", "qwen3-8b", 1, 1),
    Case("8b-tp2", "qwen3-8b", 2, 1),
    Case("0.6b-pp2", "qwen3-0.6b", 1, 2),
]
EXTRA_CASES = [  # asked for by name: their own job (PP runs eagerly and slower), or 4 GPUs
    Case("8b-pp2", "qwen3-8b", 1, 2),
    Case("8b-tp4", "qwen3-8b", 4, 1),
]


def gpus_available(device: str) -> int:
    """GPUs this host has (without initialising CUDA in this process); CPU runs use processes instead."""
    if device == "cpu":
        return 1 << 10
    import torch

    return torch.cuda.device_count()


def num_requests_for(case: Case, args: argparse.Namespace) -> int | None:
    """The per-case request count: the PP override first, then the 8B one, then the common one (or the bench's)."""
    if case.pp > 1 and args.num_requests_pp:
        return args.num_requests_pp
    if case.preset == "qwen3-8b" and args.num_requests_8b:
        return args.num_requests_8b
    return args.num_requests


def run_case(case: Case, out: Path, num_requests: int | None, device: str, timeout_s: int) -> dict:
    """One `mrv2 bench` process; returns its result row (or the failure) as a dict."""
    case_dir = out / case.name
    cmd = [
        sys.executable,
        "-m",
        "framework.entrypoints.cli",
        "bench",
        "experiment=nano",
        f"model.preset={case.preset}",
        f"parallel.tensor_parallel_size={case.tp}",
        f"parallel.pipeline_parallel_size={case.pp}",
        "bench.baselines=[]",
        "bench.decode_idle_batch=0",
        f"bench.output_dir={case_dir}",
        f"device={device}",
    ]
    if num_requests is not None:
        cmd.append(f"bench.num_requests={num_requests}")
    if device == "cpu":  # smoke run: short requests, a small cache
        cmd += [
            "bench.input_len=[8,16]",
            "bench.output_len=[4,8]",
            "model.max_model_len=64",
            "cache.num_blocks=64",
            "scheduler.max_num_seqs=8",
        ]
    print(f"== {case.name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    start, start_wall = time.perf_counter(), time.time()
    log = out / f"{case.name}.log"
    with log.open("w") as f:
        # Own session: on a timeout the whole group goes (the spawned ranks too, not only the driver).
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            rc: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    wall = time.perf_counter() - start
    row = {"case": case.name, "preset": case.preset, "tp": case.tp, "pp": case.pp, "wall_s": round(wall, 1)}
    result_file = case_dir / "bench.json"
    if rc != 0 and result_file.is_file() and result_file.stat().st_mtime > start_wall:
        print(
            f"   {case.name}: the run finished and wrote its results, but the process then did not exit ({rc})",
            file=sys.stderr,
        )
        row["exit"] = str(rc)
    elif rc != 0 or not result_file.is_file():
        tail = log.read_text().splitlines()[-5:]
        print(f"   {case.name} failed ({rc}); see {log}:\n   " + "\n   ".join(tail), file=sys.stderr)
        return row | {"error": f"exit {rc}"}
    result = json.loads(result_file.read_text())["results"][0]
    print(f"   {case.name}: {result['output_tok_per_s']:.0f} out tok/s ({wall:.0f} s with start-up)", file=sys.stderr)
    return row | {
        k: result[k]
        for k in ("num_requests", "input_tokens", "output_tokens", "seconds", "output_tok_per_s", "total_tok_per_s")
    }


def add_scaling(rows: list[dict]) -> None:
    """speedup = tok/s over the TP=1, PP=1 run of the same preset; efficiency = speedup / number of GPUs."""
    base = {r["preset"]: r["output_tok_per_s"] for r in rows if r["tp"] == r["pp"] == 1 and "error" not in r}
    for r in rows:
        if "error" not in r and r["preset"] in base:
            r["speedup"] = r["output_tok_per_s"] / base[r["preset"]]
            r["efficiency"] = r["speedup"] / (r["tp"] * r["pp"])


def table(rows: list[dict]) -> str:
    head = (
        f"{'case':<10}{'TP':>4}{'PP':>4}{'requests':>10}{'out tok':>10}{'seconds':>9}{'out tok/s':>11}"
        f"{'total tok/s':>13}{'speedup':>9}{'eff.':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<10}{r['tp']:>4}{r['pp']:>4}   {r['error']}")
            continue
        lines.append(
            f"{r['case']:<10}{r['tp']:>4}{r['pp']:>4}{r['num_requests']:>10}{r['output_tokens']:>10}"
            f"{r['seconds']:>9.2f}{r['output_tok_per_s']:>11.0f}{r['total_tok_per_s']:>13.0f}"
            f"{r.get('speedup', float('nan')):>9.2f}{r.get('efficiency', float('nan')):>7.2f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(
        [r["case"] for r in ok],
        [r["output_tok_per_s"] for r in ok],
        color=["C0" if r["tp"] * r["pp"] == 1 else "C1" if r["tp"] > 1 else "C2" for r in ok],
    )
    for bar, r in zip(bars, ok):
        ax.annotate(
            f"x{r.get('speedup', 1):.2f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("output tokens / s")
    ax.set_title('"nano" workload: tensor / pipeline parallel (x = speedup over TP=1)')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--cases", nargs="+", default=[c.name for c in CASES], choices=[c.name for c in CASES + EXTRA_CASES]
    )
    parser.add_argument("--num-requests", type=int, default=None, help="override bench.num_requests (all cases)")
    parser.add_argument("--num-requests-8b", type=int, default=None, help="override for the 8B cases only")
    parser.add_argument("--num-requests-pp", type=int, default=None, help="override for the PP cases (first)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--timeout", type=int, default=140, help="seconds per case (start-up included)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, gpus = [], gpus_available(args.device)
    for case in (c for c in CASES + EXTRA_CASES if c.name in args.cases):
        if case.tp * case.pp > gpus:  # said in the table, not silently dropped
            rows.append(
                {
                    "case": case.name,
                    "preset": case.preset,
                    "tp": case.tp,
                    "pp": case.pp,
                    "error": f"needs {case.tp * case.pp} GPUs, this host has {gpus}",
                }
            )
            continue
        rows.append(run_case(case, args.out, num_requests_for(case, args), args.device, args.timeout))
    add_scaling(rows)
    print(table(rows))
    (args.out / "parallel.json").write_text(json.dumps({"rows": rows}, indent=2))
    plot(rows, args.out / "parallel.png")
    print(f"results written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
