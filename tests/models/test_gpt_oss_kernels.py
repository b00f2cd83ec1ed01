"""gpt-oss's experts through the fused MoE Triton kernels, bf16 and MXFP4, against HF transformers.

The tiny checkpoint is `test_hf_parity_gpt_oss`'s (sliding and full layers, sinks, YaRN, 4 experts top-2, the
experts' biases randomised by `build_gpt_oss`) with `swiglu_limit` 0.1, so the clamp bites on a large share of the
gate and up values (with the default 7 a tiny random model never reaches it and a missing clamp would go unseen).

- the MoE layers on the Triton kernels (under the interpreter; the other layers stay on PyTorch to keep the file
  fast): greedy tokens equal HF's and every logits row within the float32 tolerance of HF's (the bias-dropping
  fault in the kernel's epilogue passes a greedy-only check, not this one), and the kernels did run;
- an MXFP4 checkpoint in the released layout (`helpers.mxfp4_checkpoints`), run by mrv2 both on the PyTorch
  reference and on the kernels (which dequantize in registers), against HF on the experts as transformers' own
  MXFP4 dequantization gives them: the same two checks; with chunked prefill and preemption, HF's tokens;
- planted fault kept as a control: the clamp dropped (limit 1e9) breaks the logits parity;
- refusals named: MXFP4 on another architecture, an E8M0 exponent 255 (NaN), blocks of the wrong shape, online
  FP8 on gpt-oss;
- random MXFP4 weights (the `gpt-oss-20b-mxfp4` preset's path) have a sane scale and run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import test_hf_parity
import torch
from helpers.hf_models import hf_greedy, hf_logits
from helpers.mxfp4_checkpoints import build_gpt_oss, write_gpt_oss_mxfp4
from helpers.quant_checkpoints import edit_checkpoint
from test_hf_parity import LOGITS_ATOL, LOGITS_RTOL, MAX_TOKENS, PROMPTS, SCENARIOS, run_mrv2
from test_hf_parity_gpt_oss import SPEC

import framework.layers.kernels.fused_moe as fused_moe_module
import framework.layers.kernels.fused_moe_quant as fused_moe_quant_module
from framework.entrypoints.llm import LLM
from framework.layers.kernels.fused_moe_quant import dequantize_experts
from framework.layers.quantization import finish_quantization
from framework.models.gpt_oss import GptOssExperts
from framework.models.loader import CheckpointError, build_model, init_random_weights
from framework.models.presets import preset_config

CLAMPING_SPEC = dataclasses.replace(SPEC, config_kwargs={**SPEC.config_kwargs, "swiglu_limit": 0.1}, seed=23)
PROMPT = PROMPTS[3][:20]  # 20 tokens: past the 8-token window
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt-oss-clamp")
    model = build_gpt_oss(CLAMPING_SPEC)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    return path, write_gpt_oss_mxfp4(CLAMPING_SPEC, path)


def _check_against_hf(hf_model: torch.nn.Module, path: Path, monkeypatch: pytest.MonkeyPatch) -> float:
    """Greedy run of one 20-token prompt (6 new tokens): tokens equal HF's, every logits row within tolerance of
    HF's at the same position; returns the largest |logits diff|."""
    monkeypatch.setattr(test_hf_parity, "MAX_TOKENS", NEW_TOKENS)
    run = run_mrv2(path, [PROMPT])
    tokens = run.outputs[0].token_ids
    assert tokens == hf_greedy(hf_model, PROMPT, NEW_TOKENS)
    reference = hf_logits(hf_model, PROMPT + tokens[:-1])
    worst = 0.0
    for _, seq_len, row in run.logits:
        worst = max(worst, (row - reference[seq_len - 1]).abs().max().item())
        torch.testing.assert_close(row, reference[seq_len - 1], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    return worst


def _moe_on_the_kernels(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Send the MoE layers (only: the rest stays on PyTorch, for speed) to the Triton kernels, as
    `kernels.backend=triton` would; returns the list that counts their launches."""
    calls: list[int] = []
    kernel = fused_moe_module.launch_moe_kernels
    for module in (fused_moe_module, fused_moe_quant_module):
        monkeypatch.setattr(module, "triton_enabled", lambda *a, **kw: True)
        monkeypatch.setattr(module, "launch_moe_kernels", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    return calls


def test_bf16_experts_on_the_kernels_match_hf(bf16_checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path, hf = bf16_checkpoint
    calls = _moe_on_the_kernels(monkeypatch)
    print(f"max |logits diff| bf16 experts on the kernels: {_check_against_hf(hf, path, monkeypatch):.2e}")
    assert calls, "the gpt-oss experts did not run the fused MoE kernels"


def test_a_missing_clamp_breaks_the_parity(bf16_checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path, hf = bf16_checkpoint
    epilogue = GptOssExperts.epilogue
    monkeypatch.setattr(GptOssExperts, "epilogue", lambda self: epilogue(self)._replace(limit=1e9))
    with pytest.raises(AssertionError):
        _check_against_hf(hf, path, monkeypatch)


def test_mxfp4_checkpoint_matches_hf_on_reference_and_kernels(mxfp4_checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path, hf = mxfp4_checkpoint
    print(f"max |logits diff| mxfp4 reference: {_check_against_hf(hf, path, monkeypatch):.2e}")
    calls = _moe_on_the_kernels(monkeypatch)
    print(f"max |logits diff| mxfp4 kernels: {_check_against_hf(hf, path, monkeypatch):.2e}")
    assert calls, "the MXFP4 experts did not run the fused MoE kernels"


def test_mxfp4_chunked_prefill_and_preemption(mxfp4_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """8-token steps (prefill chunks inside and across the window) and a KV pool too small for all the requests
    (preemption, recomputed prefills) for five requests: HF's greedy tokens."""
    path, hf = mxfp4_checkpoint
    run = run_mrv2(path, PROMPTS, **SCENARIOS["chunked_preempt"])  # 32 new tokens each
    assert [out.token_ids for out in run.outputs] == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    assert sum(out.num_preemptions for out in run.outputs) > 0


def test_mxfp4_refusals_are_named(mxfp4_checkpoint, bf16_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, _ = mxfp4_checkpoint
    bf16_dir = bf16_checkpoint[0]
    config = json.loads((path / "config.json").read_text())
    weights = (path / "model.safetensors").read_bytes()

    def copy(name: str, **changes) -> Path:  # type: ignore[no-untyped-def]
        dst = tmp_path / name
        dst.mkdir()
        (dst / "config.json").write_text(json.dumps({**config, **changes}))
        (dst / "model.safetensors").write_bytes(weights)
        return dst

    other = copy("qwen", architectures=["Qwen3ForCausalLM"])
    with pytest.raises(CheckpointError, match="'mxfp4' is read for GptOssForCausalLM only"):
        LLM(str(other), device="cpu")
    nan_scale = copy("nan")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    edit_checkpoint(nan_scale, **{name: torch.full((4, 64, 1), 255, dtype=torch.uint8)})
    with pytest.raises(CheckpointError, match=r"layers.1.mlp.experts.down_proj_scales: E8M0 exponent 255"):
        LLM(str(nan_scale), device="cpu")
    with pytest.raises(CheckpointError, match="these experts read mxfp4 weights, not online-fp8"):
        LLM(str(bf16_dir), device="cpu", quantization="fp8")
    misshaped = copy("shape")
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    edit_checkpoint(misshaped, **{name: torch.zeros(4, 64, 1, 16, dtype=torch.uint8)})  # H / 32 = 2 groups
    with pytest.raises(CheckpointError, match=r"gate_up_proj_blocks' has shape .* \(stored as \(4, 64, 1, 16\)\)"):
        LLM(str(misshaped), device="cpu")


def test_random_mxfp4_weights(mxfp4_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Random-weight presets (`gpt-oss-20b-mxfp4`): the packed bytes and exponents come from the MXFP4 method, the
    weights' RMS lands near `initializer_range`, and the model generates."""
    config = json.loads((mxfp4_checkpoint[0] / "config.json").read_text())
    model = build_model(config, torch.float32, torch.device("cpu"))
    init_random_weights(model, seed=0, std=0.02)
    finish_quantization(model)
    experts = model.get_submodule("model.layers.0.mlp.experts").quant_experts
    gate_up, down = dequantize_experts(experts)
    assert bool((experts.gate_up_scale == 120).all()) and len(experts.gate_up.unique()) > 200
    assert 0.01 < gate_up.pow(2).mean().sqrt().item() < 0.04 and 0.01 < down.pow(2).mean().sqrt().item() < 0.04
    assert preset_config("gpt-oss-20b-mxfp4")["quantization_config"]["quant_method"] == "mxfp4"
    out = model.model.layers[0].mlp(torch.randn(3, config["hidden_size"]))
    assert bool(torch.isfinite(out).all())
