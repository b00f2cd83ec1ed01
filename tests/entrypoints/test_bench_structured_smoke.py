"""benchmarks/bench_structured.py on the CPU (`--quick`: random_tiny, a few short requests; no timings worth
reading): both runs complete at full length, the grammar refuses nothing, the JSON report is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_structured_quick(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_structured.py"),
            "--quick",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "structured_bench.json").read_text())
    free, *halves = report["runs"]
    assert free["run"] == "free" and [(h["run"], h["fill_threads"]) for h in halves] == [("half", 2), ("half", 0)]
    assert free["fill_steps"] == 0 and free["prepare_ms_per_step"] == 0  # unconstrained: no grammar work at all
    for half in halves:
        assert free["output_tokens"] == half["output_tokens"] > 0  # the schema cannot close: same lengths
        assert half["refused_tokens"] == 0 and half["outputs_short_of_max_tokens"] == 0
        assert half["fill_steps"] > 0 and half["fill_p50_ms"] > 0
    assert {r["method"] for r in report["fill_without_model"]} >= {"llguidance LLExecutor", "filler, 2 threads"}
    assert "step time overhead per round" in res.stdout
