"""benchmarks/lora/bench_lora_kernels.py off the GPU: every variant's launches run (interpreter) and feed the
tables and the plot; without CUDA the script says so and exits without a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.lora import bench_lora_kernels as bench


def test_groups_follow_the_preset_geometry() -> None:
    groups = bench.projection_groups("qwen3-0.6b")
    assert groups == {"qkv": (1024, (2048, 1024, 1024)), "o": (2048, (1024,)), "gate_up": (1024, (3072, 3072)),
                      "down": (3072, (1024,))}  # fmt: skip
    assert bench.projection_groups("qwen3-8b")["down"] == (12288, (4096,))


def test_every_variant_runs_and_feeds_the_tables(tmp_path: Path) -> None:
    calls: list[int] = []

    def fake_time(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        calls.append(1)
        return 0.001 * len(calls)

    timed = bench.bench_group(136, (40, 24), 70, 3, device=torch.device("cpu"), time=fake_time)
    assert set(timed["variants"]) == set(bench.NAMES)
    assert len(calls) == 1 + 2 * len(bench.VARIANTS) + 4 + 2  # base, each pair, four fused launches, the sorted pair
    assert timed["variants"]["fused256"]["expand_ms"] == 0.0 and timed["variants"]["sorted"]["expand_ms"] > 0
    assert timed["variants"]["split4"]["splits"] == 3 and timed["variants"]["split2"]["splits"] == 2  # 3 K steps
    assert bench.default_variant(70, 1024) == "split4/row" and bench.default_variant(300, 1024) == "segment"
    row = {"geometry": "g", "group": "qkv", "adapters": 3, "tokens": 70, "default": bench.default_variant(70, 1024)}
    rows = [{**row, **timed}, {**row, "group": "o", **timed}]
    layer = bench._layer_table(rows)[0]
    assert layer["default"] == "split4/row" and layer["best"] == "row"  # the fake clock grows: the first is cheapest
    assert layer["base_ms"] == pytest.approx(2 * timed["base_ms"])
    bench._print_layers([layer])
    bench._plot(rows, str(tmp_path / "lora.png"))
    assert (tmp_path / "lora.png").stat().st_size > 0


def test_without_cuda_it_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
