"""The fused MoE kernels' tuned tile tables (`framework/layers/kernels/moe_launch.py`): the lookup (exact token
count, the nearest one above, past the largest, no table -> the heuristic, malformed files named in the error), the
callers' keys, the shipped files and their package data, and the kernels giving the same output under a table's
tiles (gate/up and down apart) as under the heuristic's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from framework.layers.kernels import fused_moe, fused_moe_quant, moe_launch
from framework.layers.kernels.fused_moe import fused_moe_reference, fused_moe_triton
from framework.layers.kernels.moe_launch import (
    CONFIG_DIR,
    MoeLaunchConfig,
    MoeShape,
    device_table_json,
    heuristic_launch_config,
    load_device_table,
    moe_launch_config,
    parse_device_table,
    table_file_name,
)

REPO = Path(__file__).resolve().parents[2]
GPU = "Fake GPU 80GB"
SHAPE = MoeShape(GPU, "float32", 8, 24, 40, 2)  # E=8, I=24, H=40, top-2
KEY = SHAPE[1:]


def _cfg(block_m: int, block_n: int, down_n: int | None = None) -> MoeLaunchConfig:
    cfg = MoeLaunchConfig(block_m, block_n, 32, 4, 2)
    return cfg if down_n is None else cfg._replace(down=MoeLaunchConfig(block_m, down_n, 16, 8, 3))


# Distinct tiles per token count, so each answer names the entry it came from.
TABLE = {KEY: {1: _cfg(16, 16), 4: _cfg(16, 32, down_n=16), 16: _cfg(32, 16), 64: _cfg(64, 32)}}


def _write(folder: Path, document: object, device: str = GPU) -> Path:
    path = folder / table_file_name(device)
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    _write(tmp_path, device_table_json(GPU, TABLE))
    return tmp_path


@pytest.mark.parametrize(
    "tokens,entry",
    [(1, 1), (4, 4), (16, 16), (64, 64), (2, 4), (3, 4), (5, 16), (17, 64), (63, 64), (65, 64), (9000, 64)],
)
def test_the_smallest_tabled_token_count_at_or_above_wins(folder: Path, tokens: int, entry: int) -> None:
    assert moe_launch_config(tokens * SHAPE.top_k, SHAPE.experts, SHAPE, folder) == TABLE[KEY][entry]


def test_rows_count_as_tokens_of_top_k_choices(folder: Path) -> None:
    assert moe_launch_config(3, 8, SHAPE, folder) == TABLE[KEY][4]  # 3 rows of top-2: 2 tokens


@pytest.mark.parametrize(
    "shape",
    [
        None,  # off CUDA
        SHAPE._replace(device_name="Other GPU"),  # no file for this GPU
        SHAPE._replace(dtype="bfloat16"),
        SHAPE._replace(experts=16),
        SHAPE._replace(n=48),
        SHAPE._replace(k=80),
        SHAPE._replace(top_k=4),
    ],
)
def test_without_a_matching_table_the_heuristic_decides(folder: Path, shape: MoeShape | None) -> None:
    for rows in (2, 64, 1024):
        assert moe_launch_config(rows, 8, shape, folder) == heuristic_launch_config(rows, 8)


def test_every_shipped_table_parses_and_is_named_for_its_gpu() -> None:
    """Behaviour is the heuristic's until a measured table is committed; any committed one must parse."""
    for path in CONFIG_DIR.glob("*.json"):
        document = json.loads(path.read_text())
        assert path.name == table_file_name(document["device_name"])
        assert load_device_table(str(path), document["device_name"])


def test_the_round_trip_keeps_every_entry() -> None:
    assert parse_device_table(json.loads(json.dumps(device_table_json(GPU, TABLE))), "t", GPU) == TABLE


@pytest.mark.parametrize(
    "mutate,problem",
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: {**d, "format": 2}, '"format": 1'),
        (lambda d: {**d, "device_name": "Other"}, "tabulates 'Other'"),
        (lambda d: {**d, "shapes": {}}, '"shapes" must be a list'),
        (lambda d: _entry(d, experts="8"), "positive integers"),
        (lambda d: _entry(d, tokens={}), "non-empty"),
        (lambda d: _entry(d, tokens={"0": d["shapes"][0]["tokens"]["1"]}), "positive integers"),
        (lambda d: _entry(d, tokens={"1": {"gate_up": _tiles(d)}}), '"gate_up": tiles'),
        (lambda d: _entry(d, tokens={"1": {"gate_up": _tiles(d), "down": {"block_m": 16}}}), "down: expected"),
        (lambda d: _entry(d, tokens={"1": {"gate_up": _tiles(d), "down": _tiles(d, block_m=32)}}), "share block_m"),
        (lambda d: _entry(d, tokens={"1": {"gate_up": _tiles(d, block_n=24), "down": _tiles(d)}}), "powers of two"),
        (lambda d: _entry(d, tokens={"1": {"gate_up": _tiles(d, block_k=8), "down": _tiles(d)}}), "powers of two"),
        (lambda d: {**d, "shapes": d["shapes"] * 2}, "repeats the shape"),
    ],
)
def test_a_malformed_table_is_an_error_naming_the_file(tmp_path: Path, mutate, problem: str) -> None:
    path = _write(tmp_path, mutate(device_table_json(GPU, TABLE)))
    with pytest.raises(ValueError, match=problem) as info:
        moe_launch_config(8, 8, SHAPE, tmp_path)
    assert str(path) in str(info.value)


def _entry(document: dict, **fields: object) -> dict:
    return {**document, "shapes": [{**document["shapes"][0], **fields}]}


def _tiles(document: dict, **fields: int) -> dict:
    return {**document["shapes"][0]["tokens"]["1"]["gate_up"], **fields}


def test_the_lookup_reads_each_file_once(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    moe_launch_config(8, 8, SHAPE, folder)
    monkeypatch.setattr(Path, "read_text", lambda self: pytest.fail(f"read {self} again"))
    for rows in (2, 8, 100, 5000):
        moe_launch_config(rows, 8, SHAPE, folder)


def test_an_installed_package_finds_its_tables(tmp_path: Path) -> None:
    """`pip install .` (non-editable) carries moe_configs/*.json: setuptools' build_py (the step of a wheel build
    that collects package data) of a copy of the project with a table planted, then the lookup from that layout."""
    source, target = tmp_path / "src", tmp_path / "site"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("framework", "conf", "samplers", "speculators", "model_states"):
        shutil.copytree(REPO / name, source / name, ignore=skip)
    _write(source / "framework" / "layers" / "kernels" / "moe_configs", device_table_json(GPU, TABLE))
    build = [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(target)]
    proc = subprocess.run(build, cwd=source, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    probe = (
        "import framework.layers.kernels.moe_launch as m\n"
        f"shape = m.MoeShape({GPU!r}, *{KEY!r})\n"
        "print(m.CONFIG_DIR, tuple(m.moe_launch_config(2 * shape.top_k, shape.experts, shape)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    folder, tiles = proc.stdout.split(" ", 1)
    assert Path(folder).is_relative_to(target) and tiles.strip() == str(tuple(TABLE[KEY][4]))


# ---- the callers key the lookup with their own shape -------------------------------------------------------


def _problem(m: int, h: int, i: int, e: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g)
    gate_up = torch.randn(e, 2, i, h, generator=g) * h**-0.5
    down = torch.randn(e, h, i, generator=g) * i**-0.5
    weights, ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(k, dim=-1)
    return x, gate_up, down, weights, ids


def test_fused_moe_triton_keys_the_table_with_its_shape(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys: list[tuple] = []
    launched: list[MoeLaunchConfig] = []
    monkeypatch.setattr(moe_launch, "CONFIG_DIR", folder)
    monkeypatch.setattr(fused_moe, "moe_shape", lambda device, *key: keys.append(key) or MoeShape(GPU, *key))
    monkeypatch.setattr(fused_moe, "launch_moe_kernels", lambda *args: launched.append(args[5]))
    x, gate_up, down, weights, ids = _problem(m=3, h=SHAPE.k, i=SHAPE.n, e=SHAPE.experts, k=SHAPE.top_k)
    fused_moe_triton(x, gate_up, down, weights, ids)
    assert keys == [KEY] and launched == [TABLE[KEY][4]]


def test_fused_moe_quant_keys_the_table_with_its_format(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from framework.layers.kernels.fused_moe_quant import QuantExperts

    keys: list[tuple] = []
    launched: list[MoeLaunchConfig] = []
    e, i, h, top_k = 4, 32, 64, 2
    key = ("int4", e, i, h, top_k)
    tuned = MoeLaunchConfig(16, 32, 64, 4, 2, down=MoeLaunchConfig(16, 16, 64, 8, 3))
    _write(folder, device_table_json(GPU, {key: {4: tuned}}))
    monkeypatch.setattr(fused_moe_quant, "moe_shape", lambda device, *key: keys.append(key) or MoeShape(GPU, *key))
    monkeypatch.setattr(fused_moe_quant, "launch_moe_kernels", lambda *args: launched.append(args[5]))
    monkeypatch.setattr(moe_launch, "CONFIG_DIR", folder)
    words = torch.zeros(e, 2, i, h // 8, dtype=torch.int32), torch.zeros(e, h, i // 8, dtype=torch.int32)
    scales = torch.ones(e, 2, i, h // 16), torch.ones(e, h, i // 16)
    experts = QuantExperts("int4", *words, *scales, (1, 16), (1, 16), *scales)
    x, _, _, weights, ids = _problem(m=3, h=h, i=i, e=e, k=top_k)
    fused_moe_quant.fused_moe_quant_triton(x, experts, weights, ids)
    (cfg,) = launched
    assert keys == [key]
    assert cfg.block_n == 32 and cfg.down_config().block_n == 16  # the table's entry, gate/up and down apart
    assert cfg.block_k == 16 and cfg.down_config().block_k == 16  # both narrowed into the 16-wide groups


def test_a_tables_tiles_compute_what_the_heuristics_do(folder: Path) -> None:
    """The interpreter runs the kernels with the table's tiles (down's differing from gate/up's) and with the
    heuristic's: the same output, and the reference's."""
    x, gate_up, down, weights, ids = _problem(m=5, h=SHAPE.k, i=SHAPE.n, e=SHAPE.experts, k=SHAPE.top_k)
    tuned = moe_launch_config(5 * SHAPE.top_k, SHAPE.experts, SHAPE, folder)
    assert tuned == TABLE[KEY][16] and tuned != heuristic_launch_config(10, 8)
    split = TABLE[KEY][4]
    assert split.down is not None and split.down_config() != split._replace(down=None)
    reference = fused_moe_reference(x, gate_up, down, weights, ids)
    heuristic = fused_moe_triton(x, gate_up, down, weights, ids, heuristic_launch_config(10, 8))
    torch.testing.assert_close(heuristic, reference, rtol=1e-5, atol=1e-5)
    for cfg in (tuned, split):
        torch.testing.assert_close(fused_moe_triton(x, gate_up, down, weights, ids, cfg), heuristic, rtol=0, atol=1e-6)


def test_gate_up_and_down_tiles_must_share_the_row_blocks() -> None:
    x, gate_up, down, weights, ids = _problem(m=2, h=16, i=16, e=4, k=2)
    cfg = MoeLaunchConfig(16, 16, 16, 4, 2, down=MoeLaunchConfig(32, 16, 16, 4, 2))
    with pytest.raises(ValueError, match="share block_m"):
        fused_moe_triton(x, gate_up, down, weights, ids, cfg)
