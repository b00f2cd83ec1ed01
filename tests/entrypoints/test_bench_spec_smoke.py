"""benchmarks/bench_spec.py on the CPU (`--smoke`: tiny model, no timings worth reading): it runs every engine of a
cell round-robin, writes its JSON (per-step times, eager flags, dynamic-k's decision log) and its plot; and the
host-speed comparisons."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_spec_smoke_writes_every_engine_and_the_decision_log(tmp_path):
    out = tmp_path / "spec"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_spec.py"),
            "--smoke",
            "--out",
            str(out),
            "--batch-sizes",
            "2",
            "--repeats",
            "2",
            "--pairs",
            "2",
            "--fast-pairs",
            "99",
            "--output-len",
            "6",
            "--workloads",
            "greedy-repeat",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((out / "bench_spec.json").read_text())
    engines = [r["engine"] for r in data["results"]]
    assert engines == ["none", "ngram k=0", "ngram k=1", "ngram k=2", "ngram k=3", "ngram k=5", "dynamic"]
    dynamic = data["results"][-1]
    for r in data["results"]:  # the best fixed k and dynamic-k also ran the 2 extra pair rounds
        paired = r["engine"] in ("dynamic", f"ngram k={dynamic['best_fixed_k']}")
        assert len(r["runs_tok_per_s"]) == len(r["runs_host_probe_us"]) == (4 if paired else 2)
        assert r["output_tokens"] == 2 * 6 and r["host_probe_us"] == max(r["host_probes_us"]) > 0
        assert len(r["step_ms"]) == len(r["step_eager"]) == r["steps"] > 0
    assert len(dynamic["decisions"]) == len(dynamic["k_history"]) > 0
    assert {d["reason"] for d in dynamic["decisions"]} <= {"decide", "keep", "explore", "measure"}
    best = next(r for r in data["results"] if r["engine"] == f"ngram k={dynamic['best_fixed_k']}")
    ratios = [d / f for d, f in zip(dynamic["runs_tok_per_s"], best["runs_tok_per_s"])]  # round by round
    assert dynamic["paired_vs_best"]["ratios"] == pytest.approx(ratios, abs=1e-4)
    assert dynamic["paired_vs_best"]["rounds"] == 4
    assert 0 <= dynamic["paired_vs_best"]["fast"]["rounds"] <= 4
    q1, q3 = dynamic["paired_vs_best"]["quartiles"]
    assert min(ratios) - 1e-4 <= q1 <= dynamic["paired_vs_best"]["median"] <= q3 <= max(ratios) + 1e-4
    assert dynamic["cold_tok_per_s"] > 0
    assert (out / "bench_spec.png").stat().st_size > 0
    assert "dynamic" in res.stdout  # the table


def test_paired_ratio_counts_only_rounds_where_both_runs_were_fast_host():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from host_speed import fastest_policy, paired_ratio

    dynamic = {"runs_tok_per_s": [100, 80, 110, 90], "runs_host_probe_us": [700, 1400, 700, 700]}
    fixed = {"runs_tok_per_s": [100, 100, 100, 100], "runs_host_probe_us": [700, 700, 1400, 800]}
    paired = paired_ratio(dynamic, fixed, fastest=700)
    assert paired["ratios"] == [1.0, 0.8, 1.1, 0.9] and paired["median"] == 1.0 and paired["rounds"] == 4
    assert paired["quartiles"] == [0.9, 1.1]
    assert paired["fast"] == {"median": 1.0, "rounds": 2}  # rounds 0 and 3: ratios 1.0 and 0.9
    assert paired_ratio(dynamic, fixed, fastest=500)["fast"] == {"median": None, "rounds": 0}
    runs = {"a": ([9, 5, 6], [1400, 700, 700]), "b": ([7, 7, 1], [700, 700, 1400])}
    assert fastest_policy(runs, 700) == "b"  # fast-host medians: a 6 (5, 6), b 7 (7, 7)
    runs["c"] = ([8, 8, 8], [1400, 1400, 1400])  # no fast-host run: all medians decide (a 6, b 7, c 8)
    assert fastest_policy(runs, 700) == "c"


def test_pair_rounds_share_the_time_left_after_the_fixed_rounds_of_later_cells(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_spec import pair_deadline

    # 100 s left, 3 later cells needing 20 s each for their fixed rounds: 40 s shared by 4 cells' pair rounds.
    assert pair_deadline(now=0.0, end=100.0, cell_seconds=20.0, cells_left=3) == 10.0
    assert pair_deadline(now=50.0, end=100.0, cell_seconds=5.0, cells_left=0) == 100.0  # the last cell: all of it
    assert pair_deadline(now=90.0, end=100.0, cell_seconds=20.0, cells_left=2) == 90.0  # behind: no pair rounds
    assert pair_deadline(now=0.0, end=float("inf"), cell_seconds=20.0, cells_left=3) == float("inf")  # no budget
