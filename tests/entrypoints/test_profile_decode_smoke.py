"""benchmarks/profile_decode.py on the CPU (`--device cpu`, the tiny model: no timings worth reading): the decode
phases, the kernel profile and, with `--profile-prefill`, the prefill phases and the prefill steps' device-busy
figures all reach profile.json, both chrome traces are written, and the prefill steps' host functions are
profiled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_profile_decode_smoke_with_prefill(tmp_path):
    out = tmp_path / "profile"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "profile_decode.py"),
            "--device",
            "cpu",
            "--preset",
            "random_tiny",
            "--batch",
            "2",
            "--prompt-len",
            "8",
            "--steps",
            "2",
            "--max-model-len",
            "64",
            "--profile-prefill",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((out / "profile.json").read_text())
    assert data["prefill"]["steps"] >= 1 and data["prefill"]["tokens"] == 16
    device = data["prefill_phases"]["device"]
    assert device["wall_ms_per_step"] > 0 and device["kernel_ms_per_step"] == 0  # no CUDA kernels on a CPU
    assert set(data["phases_ms"]) >= {"schedule", "execute_model", "sample_tokens", "host", "step_wall"}
    assert (out / "trace.json").stat().st_size > 0 and (out / "prefill_trace.json").stat().st_size > 0
    text = (out / "profile.txt").read_text()
    assert "prefill steps: kernels" in text
    prefill_host = text.split("host functions of one fill's prefill steps")[1].split("phases, wall ms per decode")[0]
    assert "execute_model" in prefill_host  # the prefill steps' cProfile reaches the model runner
