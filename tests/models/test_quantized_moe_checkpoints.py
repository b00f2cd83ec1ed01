"""Quantized MoE checkpoints (Qwen3-30B-A3B-FP8 style per-expert tensors) against HF transformers.

The tiny Qwen3-MoE checkpoints are written by tests/helpers/quant_checkpoints.py in the published layouts: every
linear layer and every expert's gate/up/down projection quantized (`experts.{e}.gate_proj.weight` e4m3 +
`weight_scale_inv`, or the INT4 formats' packed tensors), the router and LM head kept in 16 bits.

- FP8 block: the reference is HF transformers itself loading the FP8 checkpoint (on a CPU it dequantizes every
  weight and expert with its own FP8 integration), so the layout, the scale orientation and the expert naming are
  checked by code nobody here wrote.
- FP8 per-channel (compressed-tensors FP8_DYNAMIC), GPTQ, AWQ, compressed-tensors W4A16 experts: the reference is
  HF's `Qwen3MoeForCausalLM` holding the weights dequantized from the format's definition.
mrv2 runs in float32 on the CPU; greedy tokens must be equal and logits within float32 summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hf_models import TinySpec
from helpers.quant_checkpoints import write_quantized
from helpers.quant_parity import assert_matches_hf

from framework.entrypoints.llm import LLM
from framework.layers.kernels.fused_moe_quant import fused_moe_quant_reference, fused_moe_quant_triton
from framework.models.loader import CheckpointError

# Every dimension a multiple of 128 (HF's FP8 dequantization derives the block from the scale grid), and of the
# INT4 group 64; 8 experts, top-2.
MOE_SPEC = TinySpec(
    "qwen3moe-quant",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeConfig",
    {
        "hidden_size": 256,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "initializer_range": 0.1,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    seed=21,
)
ROUTERS = ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")  # as Qwen3-30B-A3B-FP8 lists them


def _hf_reference(model: torch.nn.Module) -> torch.nn.Module:
    model.config._attn_implementation = "eager"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def test_fp8_block_experts_match_hf_loading_the_fp8_checkpoint(tmp_path: Path) -> None:
    import transformers

    written = write_quantized("fp8-block", tmp_path, MOE_SPEC, keep=ROUTERS)
    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)  # HF's dequantization
    experts = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(ref.get_parameter(experts).float(), written.get_parameter(experts))  # our writer agrees
    llm = assert_matches_hf(tmp_path, _hf_reference(ref))
    layer = llm.engine.runner.model.model.layers[1].mlp.experts
    assert layer.gate_up_proj.dtype == torch.float8_e4m3fn and layer.quant_experts.gate_up_groups == (128, 128)
    assert layer.gate_up_proj_weight_scale_inv.shape == (8, 2, 1, 2)


@pytest.mark.parametrize("fmt", ["ct-channel", "gptq", "awq", "ct-w4a16"])
def test_quantized_experts_match_hf_dequantized(fmt: str, tmp_path: Path) -> None:
    ref = write_quantized(fmt, tmp_path, MOE_SPEC)
    llm = assert_matches_hf(tmp_path, _hf_reference(ref))
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.quant_experts.kind == ("fp8" if fmt == "ct-channel" else "int4")


@pytest.mark.parametrize("fmt", ["fp8-block", "gptq"])
def test_loaded_experts_through_the_kernels(fmt: str, tmp_path: Path) -> None:
    """The loaded layout is what the kernels read: one layer's experts, Triton (interpreter) against reference."""
    write_quantized(fmt, tmp_path, MOE_SPEC)
    model = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=32).engine.runner.model
    experts = model.model.layers[0].mlp.experts.quant_experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g)
    weights, ids = torch.softmax(torch.randn(3, 8, generator=g), -1).topk(2, dim=-1)
    ref = fused_moe_quant_reference(x, experts, weights, ids)
    torch.testing.assert_close(fused_moe_quant_triton(x, experts, weights, ids), ref, rtol=1e-5, atol=1e-5)


def test_act_order_experts_and_quantized_routers_are_refused(tmp_path: Path) -> None:
    write_quantized("gptq-act-asym", tmp_path / "act", MOE_SPEC)
    with pytest.raises(ValueError, match=r"mlp\.experts\.gate_up_proj: GPTQ act-order .* on experts"):
        LLM(str(tmp_path / "act"), device="cpu", dtype="float32", max_model_len=32)
    write_quantized("fp8-block", tmp_path / "fp8", MOE_SPEC)
    from helpers.quant_checkpoints import edit_checkpoint

    edit_checkpoint(tmp_path / "fp8", model__layers__0__mlp__experts__3__up_proj__weight_scale_inv=torch.ones(1, 3))
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj\.weight_scale_inv' has shape \(1, 3\)"):
        LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", max_model_len=32)


def test_online_fp8_experts_match_hf_on_quantized_weights(tmp_path: Path) -> None:
    """`model.quantization=fp8` on a 16-bit MoE checkpoint: every linear weight and every expert's projection in
    FP8 per output channel, against HF on a per-row e4m3 round trip of the same weights done here."""
    from helpers.hf_models import build_hf_model
    from helpers.quant_checkpoints import FP8_MAX, write_plain

    plain = build_hf_model(MOE_SPEC)
    write_plain(plain, tmp_path)
    with torch.no_grad():
        for name, param in plain.named_parameters():
            if name.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                scale = param.abs().amax(dim=-1, keepdim=True) / FP8_MAX
                param.copy_((param / scale).to(torch.float8_e4m3fn).float() * scale)
    llm = assert_matches_hf(tmp_path, _hf_reference(plain), quantization="fp8")
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.down_proj.dtype == torch.float8_e4m3fn and experts.quant_experts.down_groups == (1, 128)
