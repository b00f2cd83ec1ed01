"""Quantized Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE) against HF transformers on the dequantized weights.

Tiny checkpoints in the layout of the published FP8 releases (`tests/helpers/gdn_quant.py`): attention, the linear
attention's input and output projections, dense MLPs, shared experts and every expert quantized; `in_proj_ba` /
`in_proj_b` / `in_proj_a`, routers, norms, conv and embeddings in 16 bits. The reference is HF's own model holding
the weights each format's definition dequantizes to; mrv2 runs float32 on the CPU: greedy tokens equal, logits
within float32 summation order. The linear-attention projections are checked to run quantized (the ones the
config keeps in 16 bits to stay so).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.gdn_quant import QWEN3_5_MOE_QUANT, QWEN3_NEXT_QUANT, write_quantized_gdn
from helpers.hf_models import TinySpec
from helpers.quant_parity import assert_matches_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "spec, fmt",
    [(QWEN3_NEXT_QUANT, "fp8-block"), (QWEN3_NEXT_QUANT, "gptq"), (QWEN3_5_MOE_QUANT, "ct-w4a16")],
    ids=["qwen3_next-fp8-block", "qwen3_next-gptq", "qwen3_5_moe-ct-w4a16"],
)
def test_quantized_gdn_hybrid_matches_hf_dequantized(spec: TinySpec, fmt: str, tmp_path: Path) -> None:
    ref = write_quantized_gdn(fmt, spec, tmp_path)
    llm = assert_matches_hf(tmp_path, ref)
    layer = llm.engine.runner.model.model.layers[0]
    gdn, experts = layer.linear_attn, layer.mlp.experts
    fused = spec is QWEN3_NEXT_QUANT
    assert gdn.get_submodule("in_proj_qkvz" if fused else "in_proj_qkv").quant_method is not None
    assert gdn.out_proj.quant_method is not None and experts.quant_method is not None
    assert gdn.get_submodule("in_proj_ba" if fused else "in_proj_b").quant_method is None
