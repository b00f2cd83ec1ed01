"""scripts/bench_spec.py on the CPU (`--smoke`: tiny model, no timings worth reading): it runs every engine of a
cell round-robin, writes its JSON (per-step times, eager flags, dynamic-k's decision log) and its plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_spec_smoke_writes_every_engine_and_the_decision_log(tmp_path):
    out = tmp_path / "spec"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_spec.py"), "--smoke", "--out", str(out),
                          "--batch-sizes", "2", "--repeats", "2", "--output-len", "6", "--workloads", "greedy-repeat"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((out / "bench_spec.json").read_text())
    engines = [r["engine"] for r in data["results"]]
    assert engines == ["none", "ngram k=0", "ngram k=1", "ngram k=2", "ngram k=3", "ngram k=5", "dynamic"]
    for r in data["results"]:
        assert len(r["runs_tok_per_s"]) == 2 and r["output_tokens"] == 2 * 6
        assert len(r["step_ms"]) == len(r["step_eager"]) == r["steps"] > 0
    dynamic = data["results"][-1]
    assert len(dynamic["decisions"]) == len(dynamic["k_history"]) > 0
    assert {d["reason"] for d in dynamic["decisions"]} <= {"decide", "keep", "explore", "measure"}
    best = next(r for r in data["results"] if r["engine"] == f"ngram k={dynamic['best_fixed_k']}")
    ratios = [d / f for d, f in zip(dynamic["runs_tok_per_s"], best["runs_tok_per_s"])]  # round by round
    assert dynamic["paired_vs_best"]["ratios"] == pytest.approx(ratios, abs=1e-4)
    assert dynamic["cold_tok_per_s"] > 0
    assert (out / "bench_spec.png").stat().st_size > 0
    assert "dynamic" in res.stdout  # the table
