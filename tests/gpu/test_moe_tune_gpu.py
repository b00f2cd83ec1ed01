"""The fused MoE tile tuner end to end on a GPU (`benchmarks/moe/tune_moe_tiles.py`): compile processes, CUDA-graph
timing, the winner's check, and a table, sweep and plot the lookup reads back; on the tiny Qwen3-MoE geometry.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_moe_tune_gpu.py`
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from benchmarks.moe.tune_moe_tiles import main  # noqa: E402
from framework.layers.kernels.moe_launch import MoeShape, moe_launch_config, table_file_name  # noqa: E402


def test_the_tuner_writes_a_table_the_lookup_reads(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--geometry", "qwen3-moe-tiny", "--quick", "--tokens", "1", "64", "--jobs", "4"]
    main([*args, "--out", str(out), "--table", str(tmp_path / "no_table.json")])
    device = torch.cuda.get_device_name()
    sweep = json.loads((out / "sweep_qwen3-moe-tiny.json").read_text())
    assert [row["tokens"] for row in sweep["summary"]] == [1, 64]
    assert all(row["best_us"] <= row["default_us"] * 1.05 for row in sweep["summary"])  # the default is a candidate
    assert sum(m["ms"] is not None for m in sweep["measurements"]) > 20
    if importlib.util.find_spec("matplotlib"):  # the plot is optional: the device may lack matplotlib
        assert (out / "qwen3-moe-tiny_gbps.png").stat().st_size > 0
    shape = MoeShape(device, "bfloat16", 8, 48, 64, 2)
    table = json.loads((out / table_file_name(device)).read_text())
    tiles = table["shapes"][0]["tokens"]["64"]["gate_up"]
    assert tuple(moe_launch_config(64 * 2, 8, shape, out)[:5]) == tuple(tiles.values())
