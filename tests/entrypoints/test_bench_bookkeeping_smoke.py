"""benchmarks/bench_step_bookkeeping.py on a tiny batch: both workloads run through `EngineCore.step` with the fake
runner, the JSON has every phase, a baseline run is shown beside, and the plot is drawn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("schedule", "update", "process", "engine", "add")


def _bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_step_bookkeeping.py"),
            "--sizes",
            "4",
            "--steps",
            "5",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res


def test_bookkeeping_bench_times_every_phase_and_compares_with_a_baseline(tmp_path):
    _bench(tmp_path / "a", "--label", "before")
    data = json.loads((tmp_path / "a" / "step_bookkeeping.json").read_text())
    assert data["framework"] == str(ROOT / "framework")  # this checkout, not an installed copy
    rows = {r["workload"]: r for r in data["rows"]}
    assert set(rows) == {"decode", "churn"} and all(r["requests"] == 4 for r in rows.values())
    assert all(r["schedule"] > 0 and r["total"] == sum(r[p] for p in PHASES) for r in rows.values())
    assert rows["churn"]["add"] > 0  # requests ended and were replaced while timed
    res = _bench(tmp_path / "b", "--baseline", str(tmp_path / "a" / "step_bookkeeping.json"))
    assert res.stdout.count("before") == 2 and res.stdout.count("after") == 2
    assert (tmp_path / "b" / "step_bookkeeping.png").stat().st_size > 0
