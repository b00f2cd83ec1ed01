"""Tiny quantized Gated DeltaNet hybrid checkpoints (Qwen3-Next, Qwen3.5-MoE) and quantized MTP heads for them.

The layout is that of the published FP8 releases (Qwen/Qwen3.5-*-FP8, Qwen3-Next-*-FP8): the attention's q/k/v/o,
the linear attention's `in_proj_qkvz` (Qwen3-Next) or `in_proj_qkv` and `in_proj_z` (Qwen3.5) and `out_proj`, the
dense MLPs, the shared expert and every expert (one tensor set per expert) are quantized; the linear attention's
`in_proj_ba` / `in_proj_b` / `in_proj_a`, its conv, `A_log`, `dt_bias` and norm, the routers, the embedding and the
LM head stay in 16 bits (named in `modules_to_not_convert` / `ignore` where they are linear layers). The MTP head's
tensors follow the same rule. The quantization itself is `helpers.quant_checkpoints`'.
"""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.gdn_models import QWEN3_5_MOE, QWEN3_NEXT, slow_decay_model
from helpers.hf_models import TinySpec
from helpers.quant_checkpoints import LINEAR_SUFFIXES, quantize_linear, write_quantized
from helpers.qwen_mtp import checkpoint_layout

GDN_LINEARS = (*LINEAR_SUFFIXES, "in_proj_qkvz", "in_proj_qkv", "in_proj_z", "out_proj", "fc")
KEEP = ("in_proj_ba", "in_proj_b", "in_proj_a")  # 16-bit linear layers of the releases (besides routers, LM head)

# Every input dimension a multiple of the INT4 group (64): hidden 64, value heads 4 x 16, experts' and shared
# expert's intermediate 64, dense 128 (Qwen3-Next's MLP-only layer), the MTP fc's 2 x 64.
_DIMS = {"linear_value_head_dim": 16, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
QWEN3_NEXT_QUANT = TinySpec(
    "qwen3_next-quant", QWEN3_NEXT.architecture, QWEN3_NEXT.config_class, {**QWEN3_NEXT.config_kwargs, **_DIMS}, 41
)
QWEN3_5_MOE_QUANT = TinySpec(
    "qwen3_5_moe-quant",
    QWEN3_5_MOE.architecture,
    QWEN3_5_MOE.config_class,
    {**QWEN3_5_MOE.config_kwargs, **_DIMS},
    43,
)


def write_quantized_gdn(fmt: str, spec: TinySpec, path: Path, keep: tuple[str, ...] = ()) -> torch.nn.Module:
    """The `fmt` checkpoint of `spec` (slow decay rates) under `path`; returns the HF model holding the dequantized
    weights. `keep`: more layers left in 16 bits (e.g. the MTP head's `mtp.fc`)."""
    return write_quantized(fmt, path, spec, KEEP + keep, slow_decay_model(spec), GDN_LINEARS)


def quantize_mtp(
    fmt: str, tensors: dict[str, torch.Tensor], keep: tuple[str, ...] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An MTP head's tensors (the head's names, experts stacked) as a quantized checkpoint stores them (experts one
    per expert, each linear weight quantized unless `keep` names it), and the same layout dequantized (what the
    checkpoint means: the reference's input)."""
    stored, dequantized = {}, {}
    for name, value in checkpoint_layout(tensors, fused=False).items():
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and layer.endswith(GDN_LINEARS) and not any(k in layer for k in KEEP + keep):
            quantized, dequantized[name] = quantize_linear(fmt, layer, value, seed=len(stored))
            stored.update(quantized)
        else:
            stored[name] = dequantized[name] = value
    return stored, dequantized
