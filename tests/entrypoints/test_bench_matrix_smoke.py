"""benchmarks/bench_matrix.py: the paired summary on synthetic runs, and one real round on the CPU (the smoke
experiment, two configurations: every run completes, the JSON and plot are written)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_matrix import summarise  # noqa: E402


def _run(tok_s: float | None) -> dict:
    return {"output_tok_per_s": tok_s, "host_probe_us": 700.0, "wall_s": 1.0}


def test_the_paired_ratio_is_taken_within_rounds() -> None:
    # Round 2 ran on a half-speed host: both configurations halve, the within-round ratio stays 1.25.
    runs = {"nano": {"default": [_run(100.0), _run(50.0), _run(110.0)], "fast": [_run(125.0), _run(62.5), _run(None)]}}
    table = summarise(runs)
    assert table["nano"]["default"] == {"median_tok_per_s": 100.0, "median_paired_ratio": 1.0, "runs": 3, "failed": 0}
    fast = table["nano"]["fast"]
    assert fast["median_paired_ratio"] == 1.25 and fast["failed"] == 1 and fast["median_tok_per_s"] == 125.0


def test_one_round_on_the_cpu(tmp_path: Path) -> None:
    workload = "smoke=experiment=smoke bench.baselines=[] bench.num_requests=4 device=cpu"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_matrix.py"),
            "--rounds",
            "1",
            "--config",
            "default=",
            "--config",
            "full_step=runner.full_step_cuda_graphs=true",
            "--workload",
            workload,
            "--timeout",
            "240",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    report = json.loads((tmp_path / "matrix.json").read_text())
    cells = report["summary"]["smoke"]
    assert set(cells) == {"default", "full_step"}
    assert all(c["failed"] == 0 and c["median_tok_per_s"] > 0 for c in cells.values())
    assert (tmp_path / "matrix.png").exists() and "| smoke | full_step |" in res.stdout


def test_a_config_named_with_a_tree_runs_that_trees_code(tmp_path: Path) -> None:
    """NAME@DIR runs `framework.entrypoints.cli` from DIR: a stand-in tree whose CLI writes a fixed bench.json (from
    its own working directory, with the output path it was given) shows up as that configuration's result."""
    tree = tmp_path / "tree"
    (tree / "framework" / "entrypoints").mkdir(parents=True)
    (tree / "framework" / "__init__.py").write_text("")
    (tree / "framework" / "entrypoints" / "__init__.py").write_text("")
    (tree / "framework" / "entrypoints" / "cli.py").write_text(
        "import json, os, sys\n"
        "out = [a.split('=', 1)[1] for a in sys.argv if a.startswith('bench.output_dir=')][0]\n"
        "os.makedirs(out, exist_ok=True)\n"
        "assert os.getcwd() == os.path.dirname(os.path.abspath(__file__))[:-len('/framework/entrypoints')]\n"
        "json.dump({'results': [{'engine': 'mrv2 (stand-in)', 'output_tok_per_s': 1234.0}]},"
        " open(os.path.join(out, 'bench.json'), 'w'))\n"
    )
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_matrix.py"),
            "--rounds",
            "1",
            "--config",
            f"base@{tree}=",
            "--workload",
            "w=",
            "--timeout",
            "60",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    cells = json.loads((tmp_path / "out" / "matrix.json").read_text())["summary"]["w"]
    assert cells[f"base@{tree}"]["median_tok_per_s"] == 1234.0
    assert (tmp_path / "out" / "runs" / "w-base-r1" / "bench.json").exists()
