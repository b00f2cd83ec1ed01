"""Quantized Gemma 3 and Gemma 4 checkpoints against HF transformers running the same model dequantized.

The tiny Gemma checkpoints of the HF parity tests (8-token windows, soft-cap, scaled tied embeddings; Gemma 4's "ple"
with KV-shared layers, per-layer inputs and full layers of their own head_dim) written by the quantized-llama tests'
helper (`write_quantized`: every attention and MLP projection in the format's tensors; norms, embeddings, Gemma 4's
per-layer-input projections and layer scalars 16-bit), run in mrv2 on the CPU in float32; the reference is the HF
model holding the dequantized weights: greedy tokens equal, logits within the parity tests' tolerance. Online FP8
(`model.quantization=fp8`) is compared against a per-channel FP8 round trip of the projections done here, and a
negative control shows that round trip moves the logits past the tolerance. Gemma 4's MoE experts have no quantized
layout and pipeline parallelism is refused, both by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hf_models import TinySpec, build_hf_model
from helpers.quant_checkpoints import FP8_MAX, write_plain, write_quantized
from helpers.quant_parity import LOGITS_ATOL, LOGITS_RTOL, assert_matches_hf, mrv2_run
from test_hf_parity_gemma3 import SPEC as GEMMA3
from test_hf_parity_gemma4 import SPECS as GEMMA4

from framework.layers.quantization import is_quantized

SPECS = {"gemma3": GEMMA3, "gemma4": GEMMA4["ple"]}
CASES = [("gemma3", f) for f in ("fp8-block", "ct-channel", "ct-tensor", "gptq-act-asym", "awq", "ct-w4a16")]
CASES += [("gemma4", f) for f in ("fp8-block", "ct-channel", "gptq", "ct-w4a16")]


def _hf_model(spec: TinySpec) -> torch.nn.Module:
    """`spec`'s HF model; Gemma 4's layer scalars randomised as the parity tests do (HF sets them to one)."""
    model = build_hf_model(spec)
    gen = torch.Generator().manual_seed(spec.seed + 2000)
    with torch.no_grad():
        for name, tensor in model.named_buffers():
            if name.endswith("layer_scalar"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))
    return model


@pytest.mark.parametrize(("family", "fmt"), CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_quantized_gemma_matches_hf_dequantized(family: str, fmt: str, tmp_path: Path) -> None:
    spec = SPECS[family]
    ref = write_quantized(fmt, tmp_path, spec, model=_hf_model(spec))
    model = assert_matches_hf(tmp_path, ref).engine.runner.model
    layer = model.model.layers[2]  # a full-attention layer (Gemma 4: its own head_dim)
    assert all(is_quantized(p) for p in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj))
    assert model.model.embed_tokens.weight.dtype == torch.float32


def _quant_dequant_rows(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel FP8 e4m3 round trip (the reference for online FP8), written independently of mrv2's."""
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


@pytest.mark.parametrize("family", sorted(SPECS))
def test_online_fp8_matches_hf_on_round_tripped_weights(family: str, tmp_path: Path) -> None:
    model = _hf_model(SPECS[family])
    write_plain(model, tmp_path)
    full_tokens, full_logits, _ = mrv2_run(tmp_path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight") and "per_layer" not in name:
                param.copy_(_quant_dequant_rows(param.float()))
    llm = assert_matches_hf(tmp_path, model, quantization="fp8")
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.float8_e4m3fn
    _, fp8_logits, _ = mrv2_run(tmp_path, quantization="fp8")  # negative control: FP8 is not the 16-bit model
    assert not torch.allclose(fp8_logits[0][0], full_logits[0][0], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_gemma4_moe_experts_are_refused_quantized(tmp_path: Path) -> None:
    """The experts' quantized layout is not read: a scheme quantizing them is refused, naming the experts."""
    from framework.entrypoints.llm import LLM
    from framework.models.loader import CheckpointError

    write_plain(_hf_model(GEMMA4["moe"]), tmp_path)
    with pytest.raises(CheckpointError, match=r"layers\.0\.experts: these experts have no quantized layout"):
        LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, quantization="fp8")


@pytest.mark.parametrize("family", sorted(SPECS))
def test_pipeline_parallelism_is_refused_by_name(family: str) -> None:
    from framework.layers.parallel.context import ParallelContext
    from framework.models.hf_config import UnsupportedModelError
    from framework.models.loader import build_model

    hf = {**build_hf_model(SPECS[family]).config.to_dict(), "architectures": [SPECS[family].architecture]}
    name = "Gemma 3" if family == "gemma3" else "Gemma 4"
    with pytest.raises(UnsupportedModelError, match=f"{name} does not run under pipeline parallelism"):
        build_model(hf, torch.float32, torch.device("cpu"), ParallelContext(pp_size=2, rank=1))
    split = "num_key_value_heads=2.* not divide by .*tensor_parallel_size=4"
    with pytest.raises(UnsupportedModelError, match=split):
        build_model(hf, torch.float32, torch.device("cpu"), ParallelContext(tp_size=4, rank=1))
