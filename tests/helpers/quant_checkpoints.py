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

- `gptq` / `gptq-act-asym` (AutoGPTQ v1, 4-bit, group 64): `qweight` int32 [K/8, N] (eight input rows per int32,
  low nibble first), `qzeros` int32 [K/G, N/8] (zero - 1, eight output columns per int32), `scales` float16
  [K/G, N], `g_idx` int32 [K]; symmetric, or asymmetric with act-order (`desc_act`: groups over a permutation);
- `awq` (AutoAWQ GEMM, 4-bit, group 64): `qweight` int32 [K, N/8] and `qzeros` [K/G, N/8] packed along the output
  columns in the order (0, 2, 4, 6, 1, 3, 5, 7), `scales` float16 [K/G, N];
- `ct-w4a16` (llm-compressor W4A16, group 64): `weight_packed` int32 [N, K/8] (signed values + 8, low nibble
  first), `weight_scale` [N, K/G] in the model dtype, `weight_shape` int64 [2].

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
TP_SPEC = TinySpec(  # every projection's rows and columns per rank a multiple of 128 under tp=2
    "qwen3-quant-tp",
    "Qwen3ForCausalLM",
    "Qwen3Config",
    {**QUANT_SPEC.config_kwargs, "hidden_size": 256, "intermediate_size": 512, "num_key_value_heads": 4},
    seed=8,
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


INT4_GROUP = 64
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_along_rows(q: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R/8, C]: out[r, c] holds q[8r + j, c] in bits 4j..4j+3."""
    r, c = q.shape
    out = torch.zeros((r // 8, c), dtype=torch.int64)
    for j in range(8):
        out |= q[j::8].long() << (4 * j)
    return _to_int32(out)


def pack_along_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8]: nibble i of out[r, c] holds q[r, 8c + order[i]]."""
    r, c = q.shape
    out = torch.zeros((r, c // 8), dtype=torch.int64)
    for i in range(8):
        out |= q[:, order[i] :: 8].long() << (4 * i)
    return _to_int32(out)


def quantize_int4(
    w: torch.Tensor, col_group: torch.Tensor, sym: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (q [N, K] 0..15, scales [N, groups] rounded to `scale_dtype`, zeros [N, groups] 0..15), groups of
    input columns given by `col_group`; w ~ scales * (q - zeros)."""
    n, _ = w.shape
    groups = int(col_group.max()) + 1
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, col_group == g].float()
        if sym:
            scale = cols.abs().amax(dim=1) / 7.5
            zero = torch.full((n,), 8.0)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale = (hi - lo) / 15
            zero = (-lo / scale).round().clamp(0, 15)
        scales[:, g] = scale.to(scale_dtype).float()
        zeros[:, g] = zero
    q = (w.float() / scales[:, col_group] + zeros[:, col_group]).round().clamp(0, 15)
    return q.to(torch.uint8), scales.to(scale_dtype), zeros.to(torch.uint8)


def _int4_tensors(fmt: str, layer: str, w: torch.Tensor, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The checkpoint tensors of one INT4 layer and its dequantized weight."""
    n, k = w.shape
    col_group = torch.arange(k) // INT4_GROUP
    if fmt == "gptq-act-asym":  # act-order: groups are formed over a permutation of the input columns
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        col_group = torch.argsort(perm) // INT4_GROUP
    sym = fmt in ("gptq", "ct-w4a16")
    q, scales, zeros = quantize_int4(w, col_group, sym, torch.float32 if fmt == "ct-w4a16" else torch.float16)
    dequant = scales.float()[:, col_group] * (q.float() - zeros.float()[:, col_group])
    if fmt.startswith("gptq"):
        tensors = {
            "qweight": pack_along_rows(q.t()),
            "qzeros": pack_along_cols(zeros.t().long() - 1),
            "scales": scales.t().contiguous(),
            "g_idx": col_group.to(torch.int32),
        }
    elif fmt == "awq":
        tensors = {
            "qweight": pack_along_cols(q.t(), AWQ_ORDER),
            "qzeros": pack_along_cols(zeros.t(), AWQ_ORDER),
            "scales": scales.t().contiguous(),
        }
    else:
        tensors = {
            "weight_packed": pack_along_cols(q),
            "weight_scale": scales.contiguous(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
    return {f"{layer}.{name}": t for name, t in tensors.items()}, dequant


def _config(fmt: str) -> dict[str, Any]:
    if fmt.startswith("gptq"):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": INT4_GROUP,
            "desc_act": fmt == "gptq-act-asym",
            "sym": fmt == "gptq",
            "checkpoint_format": "gptq",
            "damp_percent": 0.01,
            "true_sequential": True,
        }
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": INT4_GROUP, "version": "gemm", "zero_point": True}
    if fmt == "ct-w4a16":
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "dynamic": False,
                        "strategy": "group",
                        "group_size": INT4_GROUP,
                        "actorder": None,
                        "observer": "minmax",
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
        }
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


def quantize_linear(
    fmt: str, layer: str, value: torch.Tensor, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The checkpoint tensors of linear layer `layer` (weight `value` [N, K]) in `fmt`, and its dequantized weight."""
    if fmt in ("gptq", "gptq-act-asym", "awq", "ct-w4a16"):
        return _int4_tensors(fmt, layer, value, seed)
    tensors: dict[str, torch.Tensor] = {}
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
    tensors[f"{layer}.weight"] = weight
    return tensors, dequant


EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # HF v5's fused MoE experts


def _quantize_experts(fmt: str, model: torch.nn.Module, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF v5's fused experts tensor `name` ([E, 2I, H] gate rows first, or [E, H, I]) written as the per-expert
    quantized tensors of public MoE checkpoints (`experts.{e}.gate_proj.weight`, `...weight_scale_inv`, ...); the
    fused parameter of `model` gets the dequantized values."""
    layers = name.removesuffix("gate_up_proj").removesuffix("down_proj")
    tensors: dict[str, torch.Tensor] = {}
    dequant = torch.empty_like(value)
    for e in range(value.shape[0]):
        if name.endswith("gate_up_proj"):
            i = value.shape[1] // 2
            parts = [("gate_proj", slice(0, i)), ("up_proj", slice(i, 2 * i))]
        else:
            parts = [("down_proj", slice(0, value.shape[1]))]
        for proj, rows in parts:
            quantized, dq = quantize_linear(fmt, f"{layers}{e}.{proj}", value[e, rows], seed=e * 3 + len(tensors))
            tensors.update(quantized)
            dequant[e, rows] = dq
    with torch.no_grad():
        model.get_parameter(name).copy_(dequant)
    return tensors


def write_quantized(
    fmt: str,
    path: Path,
    spec: TinySpec = QUANT_SPEC,
    keep: tuple[str, ...] = (),
    model: Optional[torch.nn.Module] = None,
    linear_suffixes: tuple[str, ...] = LINEAR_SUFFIXES,
) -> torch.nn.Module:
    """Write the `fmt` checkpoint of `spec` under `path` and return the HF model holding the dequantized weights.
    `keep`: substrings of layer names left unquantized (added to `modules_to_not_convert` / `ignore`); `model`: the
    HF model of `spec` to write (default: `build_hf_model(spec)`); `linear_suffixes`: the layers quantized."""
    model = build_hf_model(spec) if model is None else model
    tensors: dict[str, torch.Tensor] = {}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if spec.config_kwargs.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    for name, value in state.items():
        if name.endswith(EXPERT_SUFFIXES):
            tensors.update(_quantize_experts(fmt, model, name, value))
            continue
        layer = name.removesuffix(".weight")
        quantize = name.endswith(".weight") and layer.endswith(linear_suffixes) and not any(k in layer for k in keep)
        if not quantize:
            tensors[name] = value.contiguous()
            continue
        quantized, dequant = quantize_linear(fmt, layer, value, seed=len(tensors))
        tensors.update(quantized)
        with torch.no_grad():
            model.get_parameter(name).copy_(dequant)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = [spec.architecture]
    quant = _config(fmt)
    if keep:
        key = "ignore" if quant["quant_method"] == "compressed-tensors" else "modules_to_not_convert"
        quant[key] = list(quant.get(key) or []) + list(keep)
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
