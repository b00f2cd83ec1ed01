"""Compiling every fused-MoE tile set before serving (`fused_moe.warm_moe_launches`): with a fake table and the
launches replaced by a recorder, every distinct tile set of a shape launches once (gate/up with its tiles, down with
its own, `moe_align` with their block_m), a second call launches nothing, and the CPU and a CUDA-graph capture
launch nothing; the quantized path narrows block_k as its launches do. The GPU side (Triton compiles nothing new
after the warm-up) is `tests/gpu/test_moe_tune_gpu.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from framework.layers.kernels import fused_moe, fused_moe_quant, moe_launch
from framework.layers.kernels.fused_moe import NO_QUANT, fused_moe_triton, warm_moe_launches
from framework.layers.kernels.fused_moe_quant import QuantExperts, warm_fused_moe_quant
from framework.layers.kernels.moe_launch import (
    HEURISTIC_CONFIGS,
    MoeLaunchConfig,
    MoeShape,
    device_table_json,
    launch_configs,
    moe_launch_config,
    table_file_name,
)

GPU = "Fake GPU 80GB"
E, I, H, TOP_K = 8, 32, 64, 2
SHAPE = MoeShape(GPU, "float32", E, I, H, TOP_K)
SPLIT = MoeLaunchConfig(16, 32, 64, 4, 2, down=MoeLaunchConfig(16, 64, 32, 8, 3))  # down's own tiles
# Five token counts, four distinct tile sets (16 and 64 tokens share theirs), one with down apart.
TABLE = {
    SHAPE[1:]: {
        1: MoeLaunchConfig(16, 32, 128, 4, 4),
        4: SPLIT,
        16: MoeLaunchConfig(32, 64, 64, 4, 3),
        64: MoeLaunchConfig(32, 64, 64, 4, 3),
        256: MoeLaunchConfig(64, 128, 128, 8, 3),
    }
}
DISTINCT = [TABLE[SHAPE[1:]][count] for count in (1, 4, 16, 256)]


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import json

    (tmp_path / table_file_name(GPU)).write_text(json.dumps(device_table_json(GPU, TABLE)))
    monkeypatch.setattr(moe_launch, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(fused_moe, "_WARMED", set())  # this test's process record
    return tmp_path


class Recorder:
    """Stands in for the launches: (kernel, tiles) per call, outputs of the right shape."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpu: bool = True) -> None:
        self.calls: list[tuple[str, object]] = []
        route = fused_moe.route_moe_rows

        def route_rows(x, weights, ids, num_experts, cfg):  # type: ignore[no-untyped-def]
            self.calls.append(("align", cfg.block_m))
            return route(x, weights, ids, num_experts, cfg)

        def gate_up(x, w, routing, cfg, quant, epilogue):  # type: ignore[no-untyped-def]
            self.calls.append(("gate_up", (MoeLaunchConfig(*cfg[:5]), quant.code)))  # the tiles it reads
            return routing.empty(I, x.dtype).zero_()

        def down(act, w, routing, cfg, quant, epilogue):  # type: ignore[no-untyped-def]
            self.calls.append(("down", (MoeLaunchConfig(*cfg[:5]), quant.code)))
            return routing.empty(routing.h, act.dtype).zero_()

        monkeypatch.setattr(fused_moe, "route_moe_rows", route_rows)
        monkeypatch.setattr(fused_moe, "launch_moe_gate_up", gate_up)
        monkeypatch.setattr(fused_moe, "launch_moe_down", down)
        if gpu:  # the CPU stands in for an eager GPU launch
            monkeypatch.setattr(fused_moe, "_may_compile", lambda device: True)

    def of(self, kernel: str) -> list:
        return [what for name, what in self.calls if name == kernel]


def _inputs(m: int = 3, ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, H, generator=g)
    gate_up, down = torch.randn(E, 2, I, H, generator=g), torch.randn(E, H, I, generator=g)
    weights, ids = torch.softmax(torch.randn(m, E, generator=g), -1).topk(TOP_K, dim=-1)
    return x, gate_up, down, weights, ids.to(ids_dtype)


def test_launch_configs_are_every_answer_of_the_lookup_once(folder: Path) -> None:
    assert launch_configs(SHAPE) == DISTINCT
    answers = {moe_launch_config(m * TOP_K, E, SHAPE) for m in range(1, 600)}
    assert answers == set(DISTINCT)
    other = SHAPE._replace(n=48)  # no table: the heuristic's sets, which it answers with
    assert launch_configs(other) == list(HEURISTIC_CONFIGS)
    assert {moe_launch_config(rows, E, other) for rows in range(1, 5000)} == set(HEURISTIC_CONFIGS)


def test_every_distinct_tile_set_launches_once_with_each_kernels_own_tiles(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recorder(monkeypatch)
    assert warm_moe_launches(SHAPE, *_inputs(), NO_QUANT, NO_QUANT) == len(DISTINCT)
    assert rec.of("gate_up") == [(cfg._replace(down=None), 0) for cfg in DISTINCT]
    assert rec.of("down") == [(cfg.down_config(), 0) for cfg in DISTINCT]
    assert rec.of("down")[1][0] == SPLIT.down  # not gate/up's tiles
    assert rec.of("align") == [cfg.block_m for cfg in DISTINCT]


def test_a_second_call_launches_nothing(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    warm_moe_launches(SHAPE, *_inputs(), NO_QUANT, NO_QUANT)
    rec.calls.clear()
    assert warm_moe_launches(SHAPE, *_inputs(m=7), NO_QUANT, NO_QUANT) == 0  # another batch, the same variants
    assert rec.calls == []
    # A launch signature that compiles other variants (int32 ids reach moe_align as another pointer type) warms.
    assert warm_moe_launches(SHAPE, *_inputs(ids_dtype=torch.int32), NO_QUANT, NO_QUANT) == len(DISTINCT)


def test_the_first_table_launch_warms_and_an_explicit_config_does_not(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(fused_moe, "moe_shape", lambda device, *key: MoeShape(GPU, *key))
    x, gate_up, down, weights, ids = _inputs(m=3)
    fused_moe_triton(x, gate_up, down, weights, ids, DISTINCT[0])
    assert len(rec.of("gate_up")) == 1  # the launch itself
    rec.calls.clear()
    fused_moe_triton(x, gate_up, down, weights, ids)
    fused_moe_triton(x, gate_up, down, weights, ids)
    real = [(SPLIT._replace(down=None), 0)] * 2  # 3 tokens: the table's 4-token entry
    assert rec.of("gate_up") == [(cfg._replace(down=None), 0) for cfg in DISTINCT] + real


def test_nothing_launches_on_the_cpu(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter path: `moe_shape` is None off CUDA, and even a shape found for CPU tensors compiles
    nothing (`_may_compile` never asks CUDA about a capture there)."""
    rec = Recorder(monkeypatch, gpu=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: pytest.fail("asked CUDA on the CPU"))
    assert warm_moe_launches(None, *_inputs(), NO_QUANT, NO_QUANT) == 0
    assert warm_moe_launches(SHAPE, *_inputs(), NO_QUANT, NO_QUANT) == 0
    monkeypatch.setattr(fused_moe, "moe_shape", lambda device, *key: MoeShape(GPU, *key))
    fused_moe_triton(*_inputs(m=3))
    assert rec.of("gate_up") == [(SPLIT._replace(down=None), 0)]  # the launch itself, nothing more
    assert fused_moe._WARMED == set()


def test_nothing_launches_during_a_capture_and_the_next_eager_call_warms(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert fused_moe._may_compile(torch.device("cuda", 0)) is False
    capturing[0] = False
    assert fused_moe._may_compile(torch.device("cuda", 0)) is True
    rec = Recorder(monkeypatch, gpu=False)
    monkeypatch.setattr(fused_moe, "_may_compile", lambda device: not capturing[0])
    capturing[0] = True
    assert warm_moe_launches(SHAPE, *_inputs(), NO_QUANT, NO_QUANT) == 0 and rec.calls == []
    capturing[0] = False
    assert warm_moe_launches(SHAPE, *_inputs(), NO_QUANT, NO_QUANT) == len(DISTINCT)


def test_quantized_experts_warm_their_formats_tiles_narrowed(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """INT4 groups of 32 inputs: every block_k narrows to 32, so two table entries differing only in block_k
    are one compiled variant and launch once."""
    import json

    key = ("int4", E, I, H, TOP_K)
    wide, wider = MoeLaunchConfig(16, 32, 64, 4, 2), MoeLaunchConfig(16, 32, 128, 4, 2)
    table = {**TABLE, key: {1: wide, 8: wider, 64: SPLIT}}
    (folder / table_file_name(GPU)).write_text(json.dumps(device_table_json(GPU, table)))
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(fused_moe_quant, "moe_shape", lambda device, *key: MoeShape(GPU, *key))
    words = torch.zeros(E, 2, I, H // 8, dtype=torch.int32), torch.zeros(E, H, I // 8, dtype=torch.int32)
    scales = torch.ones(E, 2, I, H // 32), torch.ones(E, H, I // 32)
    experts = QuantExperts("int4", *words, *scales, (1, 32), (1, 32), *scales)
    x, _, _, weights, ids = _inputs()
    assert warm_fused_moe_quant(x, experts, weights, ids) == 2
    narrowed = [wide._replace(block_k=32), SPLIT._replace(block_k=32)]
    assert rec.of("gate_up") == [(cfg._replace(down=None), 2) for cfg in narrowed]
    assert rec.of("down") == [(wide._replace(block_k=32), 2), (SPLIT.down_config()._replace(block_k=32), 2)]
    assert warm_fused_moe_quant(x, experts, weights, ids) == 0


def test_fp8_w8a8_batches_warm_the_w8a16_kernels_of_smaller_ones(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large warm-up batch of FP8 experts runs W8A8 (fixed tiles, no table); the W8A16 kernels that smaller
    batches take compile with it, not in the first small step."""
    from test_fused_moe_quant import E as FP8_E
    from test_fused_moe_quant import fp8_experts
    from test_fused_moe_w8a8 import METHODS, _Experts, _moe_method

    from framework.layers.quantization import moe as quant_moe

    method = _moe_method(METHODS["fp8-block"][0])
    method.w8a8_min_tokens = 4
    experts = fp8_experts(64, 64, ((32, 32), (32, 32)))
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(fused_moe_quant, "moe_shape", lambda device, *key: MoeShape(GPU, *key))
    w8a8: list[int] = []
    monkeypatch.setattr(quant_moe, "fused_moe_w8a8_triton", lambda x, *rest, **kw: w8a8.append(len(x)) or x)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g, dtype=torch.float32)
    weights, ids = torch.softmax(torch.randn(6, FP8_E, generator=g), -1).topk(2, dim=-1)
    method.apply_experts(_Experts(experts), x, weights, ids, "triton")
    assert w8a8 == [6]
    assert [code for _, code in rec.of("gate_up")] == [1] * len(HEURISTIC_CONFIGS)  # no fp8 table: the heuristic's
    rec.calls.clear()
    method.apply_experts(_Experts(experts), x[:2], weights[:2], ids[:2], "triton")  # W8A16: already compiled
    assert w8a8 == [6] and len(rec.of("gate_up")) == 1
