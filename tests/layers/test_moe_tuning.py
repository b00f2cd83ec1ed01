"""The MoE tile tuner's device-free core (`benchmarks/moe/moe_tuning.py`) and its sweep over the real kernels
(`benchmarks/moe/tune_moe_tiles.py`, under the interpreter) on a fake timer: candidate filtering, the winner's
choice (both kernels on one block_m), failing candidates skipped, and the JSON it writes read back by the lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.moe.moe_tuning import (
    FULL_GRID,
    GEOMETRIES,
    H100_SHARED_MEMORY,
    QUICK_GRID,
    Geometry,
    Grid,
    Measurement,
    block_m_options,
    candidates,
    measure,
    pick_winner,
    shared_memory_bytes,
)
from framework.layers.kernels.moe_launch import (
    MoeLaunchConfig,
    MoeShape,
    heuristic_launch_config,
    moe_launch_config,
    table_file_name,
)

QWEN = GEOMETRIES["qwen3-30b-a3b"]


def test_block_m_grows_with_the_rows_per_expert() -> None:
    assert block_m_options(FULL_GRID, 1, QWEN) == (16,)  # 8 rows over 128 experts
    assert block_m_options(FULL_GRID, 128, QWEN) == (16, 32)  # 8 rows per expert: up to 32
    assert block_m_options(FULL_GRID, 8192, QWEN) == (16, 32, 64, 128)


@pytest.mark.parametrize("kernel", ["gate_up", "down"])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_candidates_fit_shared_memory_and_include_the_heuristic(kernel: str, tokens: int) -> None:
    found = candidates(kernel, tokens, QWEN, FULL_GRID, 2, H100_SHARED_MEMORY)
    heuristic = heuristic_launch_config(tokens * QWEN.top_k, QWEN.experts)
    assert found[0] == heuristic and len(found) == len(set(found)) > 10
    assert all(shared_memory_bytes(kernel, c, 2) <= H100_SHARED_MEMORY for c in found[1:])
    assert {c.block_m for c in found[1:]} == set(block_m_options(FULL_GRID, tokens, QWEN))
    assert len(candidates(kernel, tokens, QWEN, QUICK_GRID, 2, H100_SHARED_MEMORY)) < len(found)


def test_shared_memory_counts_both_gate_up_tiles_and_every_stage() -> None:
    cfg = MoeLaunchConfig(64, 128, 128, 8, 4)
    assert shared_memory_bytes("down", cfg, 2) == 4 * (64 + 128) * 128 * 2
    assert shared_memory_bytes("gate_up", cfg, 2) == 4 * (64 + 2 * 128) * 128 * 2
    # 256-wide tiles at 5 stages exceed sm_90's 227 KB: never candidates
    assert MoeLaunchConfig(128, 256, 256, 8, 5) not in candidates("down", 8192, QWEN, FULL_GRID, 2, H100_SHARED_MEMORY)


def test_tiles_wider_than_the_problem_are_cut_to_the_first_that_covers_it() -> None:
    tiny = Geometry("t", 8, 2, 64, 48)
    found = candidates("gate_up", 1, tiny, Grid(block_k=(64, 128, 256)), 2, H100_SHARED_MEMORY)
    assert {c.block_n for c in found[1:]} == {32, 64} and {c.block_k for c in found[1:]} == {64}


def _m(kernel: str, bm: int, bn: int, ms: float | None) -> Measurement:
    return Measurement(kernel, 1, MoeLaunchConfig(bm, bn, 64, 4, 3), ms, None if ms else "OutOfResources")


def test_the_winner_is_the_block_m_with_the_least_sum_of_both_kernels_best() -> None:
    found = [
        _m("gate_up", 16, 32, 5.0), _m("gate_up", 16, 64, 4.0), _m("down", 16, 32, 3.0), _m("down", 16, 64, 6.0),
        _m("gate_up", 32, 32, 1.0), _m("down", 32, 32, 7.5),  # the fastest gate/up, but 8.5 in all
        _m("gate_up", 64, 32, 0.5), _m("down", 64, 64, None),  # down failed at 64: no pair
    ]  # fmt: skip
    winner, total = pick_winner(found)
    assert total == 7.0 and winner == MoeLaunchConfig(16, 64, 64, 4, 3, down=MoeLaunchConfig(16, 32, 64, 4, 3))
    same = [_m("gate_up", 16, 32, 1.0), _m("down", 16, 32, 1.0)]
    assert pick_winner(same)[0].down is None  # equal tiles: one config
    with pytest.raises(ValueError, match="both kernels"):
        pick_winner([_m("gate_up", 16, 32, 1.0), _m("down", 32, 32, 1.0)])


def test_a_failing_candidate_is_kept_as_an_error_and_the_sweep_goes_on() -> None:
    configs = [MoeLaunchConfig(16, 32, 64, 4, s) for s in (2, 3, 4)]

    def time_ms(cfg: MoeLaunchConfig) -> float:
        if cfg.num_stages == 3:
            raise RuntimeError("out of resource: shared memory, Required: 300000, Hardware limit: 232448")
        return float(cfg.num_stages)

    found = measure("down", 8, configs, time_ms)
    assert [m.ms for m in found] == [2.0, None, 4.0] and "shared memory" in found[1].error


def test_the_sweep_over_the_kernels_writes_a_table_the_lookup_reads(tmp_path: Path) -> None:
    """The tuner's loop on the interpreter: every candidate's launch runs (a fake timer scores it), the winner is
    checked against the heuristic's output, and the files it writes parse; the lookup returns the winners."""
    from benchmarks.moe.tune_moe_tiles import KernelBench, tune_geometry, write_outputs

    geo = Geometry("t", 4, 2, 32, 32)
    grid = Grid(block_m=(16, 32), block_n=(16, 32), block_k=(32,), num_warps=(4,), num_stages=(2,))
    launched: list[tuple[str, MoeLaunchConfig]] = []

    def timer(launch, kernel: str, cfg: MoeLaunchConfig) -> float:  # type: ignore[no-untyped-def]
        if kernel == "down" and cfg.block_n == 32 and cfg.block_m == 16:
            raise RuntimeError("fails to compile")
        out = launch()
        assert isinstance(out, torch.Tensor) and torch.isfinite(out).all()
        launched.append((kernel, cfg))
        slow = (kernel == "gate_up" and cfg.block_n == 16) + (cfg.block_k != 32)  # the heuristic's block_k is 128
        return 1.0 + slow + cfg.block_m / 100

    bench = KernelBench(geo, torch.float32, "cpu")
    winners, rows, found = tune_geometry(bench, (1, 16), grid, timer, H100_SHARED_MEMORY, log=lambda line: None)
    assert ("down", MoeLaunchConfig(16, 16, 32, 4, 2)) in launched and any(m.error for m in found)
    gate_up, down = MoeLaunchConfig(16, 32, 32, 4, 2), MoeLaunchConfig(16, 16, 32, 4, 2)
    assert winners == {1: gate_up._replace(down=down), 16: gate_up._replace(down=down)}
    assert [row["tokens"] for row in rows] == [1, 16] and rows[0]["best_us"] == 1e3 * (1.16 + 1.16)

    table = {("float32", 4, 32, 32, 2): winners}
    write_outputs(tmp_path, "Fake GPU", table, geo, rows, found)
    sweep = json.loads((tmp_path / "sweep_t.json").read_text())
    assert sweep["summary"] == json.loads(json.dumps(rows)) and len(sweep["measurements"]) == len(found)
    assert {"kernel", "tokens", "tiles", "ms", "error"} <= set(sweep["measurements"][0])
    assert (tmp_path / table_file_name("Fake GPU")).is_file()
    shape = MoeShape("Fake GPU", "float32", 4, 32, 32, 2)
    assert moe_launch_config(2 * 8, 4, shape, tmp_path) == winners[16]


def test_a_spent_time_budget_starts_no_more_token_counts() -> None:
    from benchmarks.moe.tune_moe_tiles import KernelBench, tune_geometry

    lines: list[str] = []
    bench = KernelBench(Geometry("t", 4, 2, 32, 32), torch.float32, "cpu")
    result = tune_geometry(bench, (1, 2), Grid(), lambda *a: 1.0, H100_SHARED_MEMORY, deadline=0.0, log=lines.append)
    assert result == ({}, [], []) and "from 1 on are not tuned" in lines[0]
