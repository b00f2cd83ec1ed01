"""`mrv2 bench experiment=serve_nano` at tiny scale on the CPU: offline, then served all at once and closed-loop at
two concurrencies; the table, bench.json (gap percentiles, tokens per event, goodput, per-user throughput) and the
plot. The numbers are checked for consistency with the workload, not for speed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.config.schema import BenchConfig
from framework.entrypoints.bench.serve_report import summarize
from framework.entrypoints.bench.stream_client import StreamRecord

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def test_serve_nano_at_tiny_scale_writes_every_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "framework.entrypoints.cli",
            "bench",
            "experiment=serve_nano",
            "model=tiny",
            "device=cpu",
            "bench.num_requests=4",
            "bench.input_len=[4,8]",
            "bench.output_len=[3,6]",
            "bench.warmup_requests=1",
            "bench.request_rates=[]",
            "bench.concurrencies=[1,2]",
            "bench.requests_per_user=1",
            "scheduler.max_num_seqs=4",
            "model.max_model_len=256",
            "scheduler.max_num_batched_tokens=256",
            f"bench.output_dir={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| served, all at once |" in res.stdout and "| served, 2 users |" in res.stdout
    payload = json.loads((out / "bench.json").read_text())
    served = payload["served"]
    assert [r["label"] for r in served] == ["all at once", "1 users", "2 users"]
    assert [r["num_requests"] for r in served] == [4, 1, 2]
    all_at_once = served[0]
    outputs = payload["offline"]["output_tokens"]
    assert all_at_once["output_tokens"] == outputs  # ignore_eos: every request makes its output_len tokens
    for run in served:
        assert run["tokens_per_event"] >= 1.0 and run["tokens_per_http_chunk"] >= run["tokens_per_event"]
        assert 0.0 <= run["slo_fraction"] <= 1.0
        assert len(run["gap_s"]) == 3 and run["gap_s"][0] <= run["gap_s"][2]
    assert (out / "bench.png").stat().st_size > 0


def test_summarize_counts_events_gaps_and_goodput() -> None:
    """Two streams of known timing: one within both targets, one with a late first token."""
    bench = BenchConfig(slo_ttft_ms=100.0, slo_tpot_ms=20.0)
    fast = StreamRecord(0.0, event_times=[0.05, 0.06, 0.07, 0.08], num_http_chunks=4, completion_tokens=4)
    late = StreamRecord(0.0, event_times=[0.5, 0.51, 0.53], num_http_chunks=2, completion_tokens=6)
    run = summarize("x", [fast, late], 2.0, bench, concurrency=2)
    assert run.output_tokens == 10 and run.output_tok_per_s == 5.0
    assert run.tokens_per_event == 10 / 7 and run.tokens_per_http_chunk == 10 / 6
    assert run.slo_fraction == 0.5 and run.goodput_req_s == 0.5  # one good request in 2 s
    assert math.isclose(run.gap_s[2], 0.02)
    assert math.isclose(run.tpot_s[0], 0.01) and math.isclose(run.per_user_tok_s, 100.0)
