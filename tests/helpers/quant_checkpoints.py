"""Tiny quantized checkpoints in the layouts of public releases, and the same model dequantized for HF.

`write_quantized(spec, format, path)` builds a tiny HF Qwen3 model (random weights), quantizes each decoder
linear weight the way the format's producers do and writes config.json + model.safetensors as public checkpoints
have them:

- `fp8-block` (Qwen/Qwen3-*-FP8, HF `quant_method: fp8`): `weight` float8_e4m3fn [N, K], `weight_scale_inv`
  float32 [ceil(N/128), ceil(K/128)] (the scale of each 128 x 128 tile: amax / 448); config keys
  `quant_method`, `fmt`, `activation_scheme`, `weight_block_size`, `modules_to_not_convert`;
- `ct-channel` (llm-compressor FP8_DYNAMIC): `weight` e4m3 [N, K], `weight_scale` [N, 1] in the model dtype;
  `quantization_config` with `quant_method: compressed-tensors`, `format: float-quantized`, one config group
  targeting `Linear` (channel weights, dynamic token activations), `ignore: ["lm_head"]`;
- `ct-tensor` (llm-compressor FP8, static): `weight_scale` [1] and `input_scale` [1] per layer.

Norms, embeddings and the LM head stay float32. The HF model returned has every quantized weight replaced by its
dequantized value (what the checkpoint means), so it is the reference the quantized run must match.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from helpers.hf_models import TinySpec, build_hf_model

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# head_dim 64 x 4 heads = 256 (q rows: two full 128-blocks), 2 KV heads (k/v rows: one block), hidden 192 (the
# last K block of q/k/v/gate/up is partial), intermediate 320 (gate/up rows and down_proj's K: a partial block).
QUANT_SPEC = TinySpec(
    "qwen3-quant",
    "Qwen3ForCausalLM",
    "Qwen3Config",
    {
        "hidden_size": 192,
        "intermediate_size": 320,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "initializer_range": 0.1,
    },
    seed=7,
)
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 scale_inv [ceil(N/block), ceil(K/block)]): each tile's amax maps to 448."""
    n, k = w.shape
    sn, sk = -(-n // block), -(-k // block)
    padded = torch.zeros(sn * block, sk * block)
    padded[:n, :k] = w.float()
    tiles = padded.view(sn, block, sk, block).abs().amax(dim=(1, 3))
    scale = torch.where(tiles > 0, tiles / FP8_MAX, torch.ones_like(tiles))
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], scale [N, 1] in `scale_dtype`), quantized with the stored (rounded) scale."""
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).to(scale_dtype)
    return (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tensor(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], scale [1])."""
    scale = (w.float().abs().amax() / FP8_MAX).reshape(1).to(scale_dtype)
    return (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _config(fmt: str) -> dict[str, Any]:
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head"],
        }
    static = fmt == "ct-tensor"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": False,
                    "strategy": "tensor" if static else "channel",
                    "observer": "minmax",
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": not static,
                    "strategy": "tensor" if static else "token",
                },
                "output_activations": None,
            }
        },
    }


def write_quantized(fmt: str, path: Path, spec: TinySpec = QUANT_SPEC, keep: tuple[str, ...] = ()) -> torch.nn.Module:
    """Write the `fmt` checkpoint of `spec` under `path` and return the HF model holding the dequantized weights.
    `keep`: substrings of layer names left unquantized (added to `modules_to_not_convert` / `ignore`)."""
    model = build_hf_model(spec)
    tensors: dict[str, torch.Tensor] = {}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if spec.config_kwargs.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    for name, value in state.items():
        layer = name.removesuffix(".weight")
        quantize = name.endswith(".weight") and layer.endswith(LINEAR_SUFFIXES) and not any(k in layer for k in keep)
        if not quantize:
            tensors[name] = value.contiguous()
            continue
        if fmt == "fp8-block":
            weight, scale = quantize_block(value)
            tensors[f"{layer}.weight_scale_inv"] = scale
            dequant = (
                weight.float()
                * scale.repeat_interleave(128, 0)[: value.shape[0]].repeat_interleave(128, 1)[:, : value.shape[1]]
            )
        elif fmt == "ct-channel":
            weight, scale = quantize_rows(value, torch.bfloat16)
            tensors[f"{layer}.weight_scale"] = scale
            dequant = weight.float() * scale.float()
        elif fmt == "ct-tensor":
            weight, scale = quantize_tensor(value, torch.float32)
            tensors[f"{layer}.weight_scale"] = scale
            tensors[f"{layer}.input_scale"] = torch.tensor([0.05], dtype=torch.float32)
            dequant = weight.float() * scale.float()
        else:
            raise ValueError(fmt)
        tensors[name] = weight
        with torch.no_grad():
            model.get_parameter(name).copy_(dequant)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = [spec.architecture]
    quant = _config(fmt)
    if keep:
        quant["modules_to_not_convert" if fmt == "fp8-block" else "ignore"] += list(keep)
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return model


def write_plain(model: torch.nn.Module, path: Path) -> Path:
    """`model` (e.g. the dequantized reference) as a 16/32-bit checkpoint, for mrv2's online quantization."""
    model.save_pretrained(path, safe_serialization=True)
    return path


def edit_checkpoint(path: Path, rename: Optional[dict[str, str]] = None, **replace: torch.Tensor) -> None:
    """Rewrite `path`'s model.safetensors with tensors replaced (`replace`, names with `.` as `__`) or renamed."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    for key, value in replace.items():
        tensors[key.replace("__", ".")] = value
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
