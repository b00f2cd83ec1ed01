"""Tiny gpt-oss checkpoints with MXFP4 experts, in the layout of the released gpt-oss weights.

`write_gpt_oss_mxfp4(spec, path)` builds the tiny HF `GptOssForCausalLM` of `spec`, quantizes each layer's
experts the way the released checkpoints store them and writes config.json + model.safetensors:

- `mlp.experts.gate_up_proj_blocks` uint8 [E, 2I, H / 32, 16]: row n of W^T (HF's `gate_up_proj [E, H, 2I]`
  transposed, so rows alternate gate, up), its H inputs in groups of 32, two FP4 e2m1 codes a byte (input 2c in
  the low nibble); `..._scales` uint8 [E, 2I, H / 32]: E8M0 exponents (bias 127) of each group;
- `mlp.experts.down_proj_blocks` [E, H, I / 32, 16] and `down_proj_scales` [E, H, I / 32] likewise from
  `down_proj [E, I, H]`;
- biases (randomised, `build_gpt_oss`), router, attention, norms and embeddings as they are (float32);
- `quantization_config: {"quant_method": "mxfp4", "modules_to_not_convert": [...]}` as the releases have it.

The HF model returned holds the experts as transformers itself dequantizes the written tensors
(`transformers.integrations.mxfp4.convert_moe_packed_tensors`, what its loader runs with `dequantize=True`), so it
is the reference an mrv2 run of the checkpoint must match.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from helpers.hf_models import TinySpec, build_hf_model

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (blocks uint8 [..., N, K / 32, 16], scales uint8 [..., N, K / 32]): per group of 32
    inputs the smallest power of two putting its largest magnitude within e2m1's 6, values rounded to the nearest
    e2m1 code."""
    *lead, n, k = w.shape
    groups = w.float().reshape(*lead, n, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)
    nearest = (scaled.abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs().argmin(-1)
    codes = (nearest + 8 * (scaled < 0).long()).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8)


def build_gpt_oss(spec: TinySpec) -> torch.nn.Module:
    """`build_hf_model(spec)` with the experts' biases randomised too: HF zeroes `gate_up_proj_bias` and
    `down_proj_bias` (their names do not end in `.bias`, so `build_hf_model` leaves them), and a dropped bias
    would go unseen."""
    model = build_hf_model(spec)
    for module in model.modules():  # transformers before ~5.2x fixes the clamp at 1.702 / 7.0, ignoring the config
        if hasattr(module, "limit") and hasattr(module, "alpha"):
            module.alpha = float(getattr(model.config, "swiglu_alpha", 1.702))
            module.limit = float(getattr(model.config, "swiglu_limit", 7.0))
    gen = torch.Generator().manual_seed(spec.seed + 2000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def write_gpt_oss_mxfp4(spec: TinySpec, path: Path) -> torch.nn.Module:
    """Write the MXFP4 checkpoint of `spec` (a gpt-oss `TinySpec`) under `path`; return the HF model holding the
    experts as transformers dequantizes them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = build_gpt_oss(spec)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            tensors[name] = value.detach().contiguous()
            continue
        blocks, scales = quantize_mxfp4(value.detach().transpose(1, 2))  # [E, K, N] -> rows of W^T
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            model.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = [spec.architecture]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return model
