"""Compiling every delta-rule kernel variant before serving (`gated_delta_rule.warm_delta_rule_variants`): on a
stand-in for an eager GPU launch (the CPU under the interpreter), both kernels launch once with and without tails
and snapshots, on scratch buffers, for a geometry's first call only; the CPU and a capture launch nothing. The GPU
side (nothing compiles after the first launch) is `tests/gpu/test_gdn_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels import gated_delta_rule as gdr
from framework.layers.kernels.gated_delta_rule import DeltaRuleInputs, warm_delta_rule_variants

HK, H, DK, DV = 2, 4, 16, 16
COMBOS = {(tails, snaps) for tails in (False, True) for snaps in (False, True)}


class Recorder:
    """Wraps both kernel wrappers: (kernel, has tails, has snapshots) per launch; the launches still run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpu: bool = True) -> None:
        self.calls: list[tuple[str, bool, bool]] = []
        for name in ("gated_delta_rule_varlen_triton", "chunk_gated_delta_rule_varlen_triton"):
            monkeypatch.setattr(gdr, name, self._wrap(name, getattr(gdr, name)))
        monkeypatch.setattr(gdr, "_WARMED", set())  # this test's process record
        monkeypatch.setattr(gdr, "_may_compile", lambda device: gpu)

    def _wrap(self, name, launch):  # type: ignore[no-untyped-def]
        def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
            tails, snapshots, _pool = args[-3:]  # both wrappers end (..., tail_states, snapshots, snapshot_pool)
            self.calls.append((name, tails is not None, snapshots is not None))
            return launch(*args, **kwargs)

        return recorded


def _inputs(h: int = H, t: int = 3) -> tuple[DeltaRuleInputs, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    inp = DeltaRuleInputs(
        torch.randn(t, HK, DK, generator=g), torch.randn(t, HK, DK, generator=g), torch.randn(t, h, DV, generator=g),
        -torch.rand(t, h, generator=g), torch.rand(t, h, generator=g),
    )  # fmt: skip
    return inp, torch.randn(5, h, DK, DV, generator=g)


def test_every_variant_of_both_kernels_launches_once_per_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    inp, state = _inputs()
    before = state.clone()
    warm_delta_rule_variants(inp, state)
    for kernel in ("gated_delta_rule_varlen_triton", "chunk_gated_delta_rule_varlen_triton"):
        assert sorted((t, s) for name, t, s in rec.calls if name == kernel) == sorted(COMBOS), kernel
    assert len(rec.calls) == 8
    assert torch.equal(state, before), "the warm-up wrote the real state"
    warm_delta_rule_variants(inp, state)
    warm_delta_rule_variants(_inputs(t=7)[0], state)  # another batch, the same geometry
    assert len(rec.calls) == 8
    other, other_state = _inputs(h=2 * H)
    warm_delta_rule_variants(other, other_state)  # another head count: compiled again
    assert len(rec.calls) == 16


def test_cpu_and_capture_launch_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch, gpu=False)
    warm_delta_rule_variants(*_inputs())
    assert rec.calls == []
    assert gdr._may_compile(torch.device("cpu")) is False


def test_the_check_of_the_record_fails_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: a warm-up that forgot the record would launch its eight variants at every call."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(gdr, "_WARMED", type("Forgetful", (set,), {"add": lambda self, key: None})())
    warm_delta_rule_variants(*_inputs())
    warm_delta_rule_variants(*_inputs())
    assert len(rec.calls) == 16
