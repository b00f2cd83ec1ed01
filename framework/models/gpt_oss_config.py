"""The gpt-oss geometry mrv2 reads from an HF `config.json`: per-layer attention kinds, sinks, YaRN RoPE, experts."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from framework.models.hf_config import DecoderConfig, UnsupportedModelError

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    """gpt-oss: every layer a top-k MoE of `num_experts` experts (biases, clamped SwiGLU), attention with a learned
    sink per head, layers alternating between a `sliding_window` and full attention (`layer_types`)."""

    num_experts: int = 0
    num_experts_per_tok: int = 1
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_types: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "GptOssConfig":
        """Read an HF gpt-oss config; a quantization other than MXFP4 experts (the released checkpoints) is refused
        by name."""
        quant = cfg.get("quantization_config") or {}
        method = str(quant.get("quant_method", "mxfp4")).lower() if isinstance(quant, dict) else repr(quant)
        if method != "mxfp4":
            raise UnsupportedModelError(
                f"quantization_config.quant_method={method!r}: gpt-oss reads bf16 checkpoints and MXFP4 experts "
                "(quant_method 'mxfp4') only"
            )
        base = super().from_hf({**cfg, "sliding_window": None})
        num_layers = base.num_layers
        layer_types = tuple(cfg.get("layer_types") or (SLIDING if i % 2 == 0 else FULL for i in range(num_layers)))
        if len(layer_types) != num_layers or set(layer_types) - {SLIDING, FULL}:
            raise UnsupportedModelError(f"layer_types={list(layer_types)} must name {num_layers} of {SLIDING}/{FULL}")
        window = cfg.get("sliding_window")
        if SLIDING in layer_types and not (isinstance(window, int) and window > 0):
            raise UnsupportedModelError(f"sliding_window={window!r} must be a positive int for sliding layers")
        num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok") or 1)
        if not 1 <= top_k <= num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be in 1..num_local_experts={num_experts}")
        return dataclasses.replace(
            base,
            sliding_window=window if SLIDING in layer_types else None,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            layer_types=layer_types,
        )

    def layer_window(self, layer: int) -> int:
        """Keys a query of layer `layer` sees (its own included); 0 for a full-attention layer."""
        return int(self.sliding_window or 0) if self.layer_types[layer] == SLIDING else 0

    def check_max_model_len(self, max_model_len: int) -> None:
        """Any length: window layers attend through their window."""

    def rope_inv_freq(self) -> torch.Tensor:
        """[head_dim // 2] float32: YaRN's blend of interpolated and extrapolated frequencies, else the base rule."""
        if self.rope.get("rope_type") != "yarn":
            return super().rope_inv_freq()
        theta, dim = float(self.rope["rope_theta"]), self.head_dim
        factor = float(self.rope["factor"])
        old_len = float(self.rope["original_max_position_embeddings"])
        beta_fast, beta_slow = float(self.rope.get("beta_fast") or 32), float(self.rope.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.rope.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        extrapolated = 1 - ramp  # share of the unscaled frequency
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated

    def rope_attention_factor(self) -> float:
        """YaRN's scale of cos and sin (1.0 for other RoPE kinds)."""
        if self.rope.get("rope_type") != "yarn":
            return 1.0
        if self.rope.get("attention_factor") is not None:
            return float(self.rope["attention_factor"])
        factor = float(self.rope["factor"])
        mscale, mscale_all = self.rope.get("mscale"), self.rope.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all:
            return get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all))
        return get_mscale(factor)
