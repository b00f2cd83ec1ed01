"""Programmatic dependent launch (framework/layers/kernels/pdl.py) without a GPU.

Claims: `kernels.programmatic_launch` resolves as documented (off on a CPU and under the interpreter, on for a
faked sm_90 device, off for an older GPU or a Triton without `launch_pdl`, with a log line naming why); the
small-batch path hands `pdl=True` to every kernel of a decode step when it is on, and `pdl=False` elsewhere; the
GEMV's weight-first tile (`prefetch_k`, whole, part of K, none) gives the reference's results in the interpreter;
compiled for sm_90 (tests/gpu/pdl_ptx_check.py, a subprocess), each PDL variant's PTX holds one
`griddepcontrol.wait` and one `.launch_dependents`, the others none, and the GEMV's weight loads come before the
wait. Negative control: the ordering criterion rejects the kernels that wait first (nothing loaded before it).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_small_batch_kernels import EPS, VARIANTS, _case, assert_gemv_matches

import framework.layers.kernels.pdl as pdl_module
import framework.models.llama as llama
import framework.models.small_batch as small_batch
from framework.config.schema import Mrv2Config
from framework.layers.attention.qk_norm_rope import qk_norm_rope_store_reference
from framework.layers.kernels.layer_ops import rms_norm_reference
from framework.layers.kernels.pdl import pdl_launch_kwargs, pdl_supported, resolve_programmatic_launch
from framework.layers.kernels.small_batch_ops import fused_linear_reference
from framework.layers.kernels.triton_gemv import gemv_tiles, gemv_triton
from framework.models.small_batch import enable_small_batch
from framework.params.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A CUDA device of the capability the test sets (default 9.0), outside the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    return capability


def test_off_on_a_cpu_and_under_the_interpreter(caplog: pytest.LogCaptureFixture) -> None:
    assert not pdl_supported(torch.device("cpu"))
    with caplog.at_level(logging.DEBUG, logger=pdl_module.__name__):
        assert resolve_programmatic_launch("on", torch.device("cpu")) is False
        assert resolve_programmatic_launch("auto", torch.device("cpu")) is False
        assert resolve_programmatic_launch("off", torch.device("cpu")) is False
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "programmatic dependent launch off" in warned[0].getMessage()


def test_interpreter_wins_even_on_a_hopper(fake_gpu: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in pdl_module.pdl_unsupported_reason(CUDA)
    assert resolve_programmatic_launch("on", CUDA) is False


def test_on_for_a_faked_sm90_off_for_older_gpus_and_old_tritons(
    fake_gpu: list, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert pdl_module.triton_has_pdl(), "Triton >= 3.6 has launch_pdl and gdc_wait"
    assert resolve_programmatic_launch("auto", CUDA) and resolve_programmatic_launch("on", CUDA)
    assert not resolve_programmatic_launch("off", CUDA)
    fake_gpu[0] = (10, 0)
    assert resolve_programmatic_launch("auto", CUDA)
    fake_gpu[0] = (8, 9)
    assert not resolve_programmatic_launch("auto", CUDA)
    fake_gpu[0] = (9, 0)
    monkeypatch.setattr(pdl_module, "triton_has_pdl", lambda: False)
    with caplog.at_level(logging.INFO, logger=pdl_module.__name__):
        assert not resolve_programmatic_launch("auto", CUDA)
    assert any("launch_pdl" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


def test_launch_kwargs_and_config_default() -> None:
    assert pdl_launch_kwargs(False) == {}  # the kernels' defaults; no launch option the interpreter may refuse
    assert pdl_launch_kwargs(True) == {"USE_PDL": True, "launch_pdl": True}
    assert Mrv2Config().kernels.programmatic_launch == "auto"
    with pytest.raises(ValueError):
        Mrv2Config.model_validate({"kernels": {"programmatic_launch": "always"}})


def test_an_engine_on_the_cpu_resolves_it_off(tiny_llm_factory: Any) -> None:
    llm = tiny_llm_factory(small_batch_kernels="on", programmatic_launch="on")
    model = llm.engine.runner.model
    assert model.model.layers[0].small_batch_max_tokens == 1
    assert model.programmatic_launch is False and model.model.layers[0].programmatic_launch is False


def test_the_small_batch_path_passes_pdl_to_every_kernel(
    tiny_llm_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the switch forced on (as on an H200), each decode step's GEMVs, q/k norm + RoPE, attention and final
    norm get pdl=True, and the prefill (the default path) pdl=False; the ops run their references here."""
    llm = tiny_llm_factory(small_batch_kernels="on", cuda_graphs=False)
    model = llm.engine.runner.model
    assert enable_small_batch(model, 1, programmatic_launch=True) > 0
    calls: list[tuple[str, int, bool]] = []  # (op, tokens, pdl)

    def linear(x: torch.Tensor, *args: Any, pdl: bool = False, backend: str = "auto", **kwargs: Any):  # type: ignore[no-untyped-def]
        calls.append(("linear", x.shape[0], pdl))
        return fused_linear_reference(x, *args, **kwargs)

    def rope(qkv: torch.Tensor, *args: Any):  # type: ignore[no-untyped-def]
        calls.append(("rope", qkv.shape[0], bool(args[10]) if len(args) >= 11 else False))  # then the backend
        return qk_norm_rope_store_reference(qkv, *args[:10])

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual=None, pdl: bool = False, backend="auto"):  # type: ignore
        calls.append(("norm", x.shape[0], pdl))
        return rms_norm_reference(x, weight, eps, residual)

    attention = model.attention

    def attend(q: torch.Tensor, *args: Any, pdl: bool = False, **kwargs: Any):  # type: ignore[no-untyped-def]
        calls.append(("attention", q.shape[0], pdl))
        return attention(q, *args, **kwargs)

    monkeypatch.setattr(small_batch, "fused_linear", linear)
    monkeypatch.setattr(llama, "qk_norm_rope_store", rope)
    monkeypatch.setattr(llama, "rms_norm", norm)
    monkeypatch.setattr(model, "attention", attend)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0))
    decode = {(op, pdl) for op, tokens, pdl in calls if tokens == 1}
    assert decode == {("linear", True), ("rope", True), ("attention", True), ("norm", True)}, decode
    assert {pdl for op, tokens, pdl in calls if tokens > 1 and op != "linear"} == {False}


@pytest.mark.parametrize("prefetch_k", [None, 0, 128, 1024])
@pytest.mark.parametrize("variant", ["add_norm_silu_bias", "logits", "add_norm_bias"])
def test_gemv_weight_first_tile_matches_the_reference(prefetch_k: int | None, variant: str) -> None:
    """The first tile covering all of K (None: the rule, here 1024 >= K), part of it (128: the chunk loop does
    the rest) or none (0: today's chunk loop alone), at one and three rows."""
    has_bias, has_norm, has_residual, silu_mul, fp32_out = VARIANTS[variant]
    for m in (1, 3):
        x, weight, bias, norm_weight, residual = _case(m, 12, 300, torch.bfloat16, seed=m, silu_mul=silu_mul)
        kwargs = dict(
            bias=bias if has_bias else None,
            norm_weight=norm_weight if has_norm else None,
            eps=EPS,
            residual=residual if has_residual else None,
            silu_mul=silu_mul,
            out_dtype=torch.float32 if fp32_out else None,
        )
        tiles = gemv_tiles(m, 12, 300, 2, block_k=64, silu_mul=silu_mul, prefetch_k=prefetch_k)
        assert tiles.prefetch_k == (512 if prefetch_k is None else prefetch_k)
        out, summed = gemv_triton(x, weight, **kwargs, tiles=tiles)  # type: ignore[arg-type]
        ref, ref_summed = fused_linear_reference(x, weight, **kwargs)  # type: ignore[arg-type]
        assert_gemv_matches(out, ref)
        assert (summed is None) == (ref_summed is None) and (summed is None or torch.equal(summed, ref_summed))


def test_prefetch_rule_at_real_shapes() -> None:
    """32 KB first: the whole tile of qkv, o_proj, gate_up and the LM head at the 0.6B shapes, half of down's."""
    assert gemv_tiles(1, 4096, 1024, 2).prefetch_k == 1024
    assert gemv_tiles(1, 1024, 2048, 2).prefetch_k == 2048
    assert gemv_tiles(1, 3072, 1024, 2, silu_mul=True).prefetch_k == 1024
    assert gemv_tiles(1, 1024, 3072, 2).prefetch_k == 2048
    assert gemv_tiles(1, 151936, 1024, 2).prefetch_k == 1024
    assert gemv_tiles(1, 4096, 12288, 2).prefetch_k == 2048  # 8B down: 2,048 first, ten chunks after
    with pytest.raises(AssertionError):
        gemv_tiles(1, 64, 300, 2, prefetch_k=100)


@pytest.fixture(scope="module")
def ptx_reports() -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "gpu" / "pdl_ptx_check.py")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_sm90_ptx_has_griddepcontrol_only_with_pdl(ptx_reports: list[dict]) -> None:
    kernels = {r["kernel"] for r in ptx_reports}
    assert kernels == {"gemv", "qk_norm_rope_store", "paged_attention", "split_kv_reduce", "rms_norm"}
    for r in ptx_reports:
        expect = 1 if r["use_pdl"] else 0
        assert r["launch_pdl"] == r["use_pdl"], r
        assert r["griddepcontrol_wait"] == expect and r["griddepcontrol_launch_dependents"] == expect, r
    assert sum(r["use_pdl"] for r in ptx_reports) * 2 == len(ptx_reports)  # each kernel compiled both ways


def test_sm90_ptx_gemv_loads_its_weights_before_the_wait(ptx_reports: list[dict]) -> None:
    def weights_first(r: dict) -> bool:  # the criterion: some loads were issued before the wait
        return r["ld_global_before_wait"] > 0

    gemvs = [r for r in ptx_reports if r["kernel"] == "gemv" and r["use_pdl"]]
    assert len(gemvs) == 3 and all(weights_first(r) for r in gemvs)
    for r in gemvs:  # whole tile first (qkv, gate/up): every weight load precedes the wait; x comes after
        assert r["ld_global"] > r["ld_global_before_wait"], r
    long_k = next(r for r in gemvs if r["shape"]["K"] > r["shape"]["PRE_K"])
    assert long_k["ld_global"] - long_k["ld_global_before_wait"] > 1  # the chunks past PRE_K load after it
    waits_first = [r for r in ptx_reports if r["use_pdl"] and r["kernel"] in ("qk_norm_rope_store", "paged_attention")]
    assert waits_first and not any(weights_first(r) for r in waits_first)  # negative control
