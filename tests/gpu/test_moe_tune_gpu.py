"""The fused MoE tile tuner end to end on a GPU (`benchmarks/moe/tune_moe_tiles.py`): compile processes, CUDA-graph
timing, the winner's check, and a table, sweep and plot the lookup reads back; on the tiny Qwen3-MoE geometry. And a
table's tile sets all compiled by a shape's first launch (`warm_moe_launches`), none in later steps.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_moe_tune_gpu.py`
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
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


GATE_UP_KERNEL = "framework.layers.kernels.fused_moe._moe_gate_up_kernel"
DOWN_KERNEL = "framework.layers.kernels.fused_moe._moe_down_kernel"


def test_a_tables_tile_sets_all_compile_at_the_first_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table of two tile sets (4 and 64 tokens, the first with down's own tiles): the first launch of the shape,
    at 3 tokens, compiles both sets of both kernels, and launches at token counts of either set (16-divisible
    and not) compile nothing new. Control: with the warm-up switched off, another shape compiles its second set in
    the step that first takes it."""
    from framework.entrypoints.bench.triton_compiles import compiled_variants, new_variants
    from framework.layers.kernels import fused_moe, moe_launch
    from framework.layers.kernels.fused_moe import fused_moe_reference, fused_moe_triton
    from framework.layers.kernels.moe_launch import MoeLaunchConfig, device_table_json

    device = torch.cuda.get_device_name()
    e, h, top_k = 8, 96, 2  # sizes no other test compiles
    first = MoeLaunchConfig(16, 32, 32, 4, 2, down=MoeLaunchConfig(16, 64, 64, 4, 3))
    second = MoeLaunchConfig(32, 64, 32, 4, 2)
    table = {("bfloat16", e, i, h, top_k): {4: first, 64: second} for i in (80, 112)}
    (tmp_path / table_file_name(device)).write_text(json.dumps(device_table_json(device, table)))
    monkeypatch.setattr(moe_launch, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(fused_moe, "_WARMED", set())
    torch.manual_seed(0)
    x = torch.randn(200, h, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(200, e, device="cuda"), -1).topk(top_k, dim=-1)

    def experts(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = torch.randn(e, 2, i, h, device="cuda") * h**-0.5
        return gate_up.bfloat16(), (torch.randn(e, h, i, device="cuda") * i**-0.5).bfloat16()

    experts_of = {i: experts(i) for i in (80, 112)}

    def run(m: int, i: int) -> torch.Tensor:
        out = fused_moe_triton(x[:m], *experts_of[i], weights[:m], ids[:m])
        torch.cuda.synchronize()
        return out

    with monkeypatch.context() as off:  # the control: no warm-up
        off.setattr(fused_moe, "warm_moe_launches", lambda *args, **kwargs: 0)
        run(3, 112)
        before = compiled_variants()
        run(64, 112)
        assert new_variants(before, compiled_variants()).get(GATE_UP_KERNEL) == 1

    before = compiled_variants()
    start = time.perf_counter()
    run(3, 80)
    print(f"first launch with the warm-up of 2 tile sets: {time.perf_counter() - start:.2f} s")
    warmed = new_variants(before, compiled_variants())
    assert warmed.get(GATE_UP_KERNEL) == 2 and warmed.get(DOWN_KERNEL) == 2, warmed
    before = compiled_variants()
    for m in (1, 4, 5, 16, 17, 48, 64, 65, 200):
        out = run(m, 80)
    assert new_variants(before, compiled_variants()) == {}
    reference = fused_moe_reference(x, *experts_of[80], weights, ids)
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
