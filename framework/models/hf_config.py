"""The decoder-only geometry mrv2 reads from an HF `config.json`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


class UnsupportedModelError(ValueError):
    """A checkpoint mrv2 cannot run; the message says which config field and why."""


# What HF's config class of an architecture assumes for a key that config.json leaves out, where that differs from
# mrv2's generic defaults below (hand-written config.json files omit keys; HF reads them with these values).
HF_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {"head_dim": 128},
    "MistralForCausalLM": {"sliding_window": 4096},
    "MixtralForCausalLM": {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
}


# Architectures whose HF model attends through `sliding_window` (Llama's ignores the key).
WINDOWED_ARCHITECTURES = ("Mistral", "Mixtral", "Qwen2", "Qwen3")


@dataclass(frozen=True)
class DecoderConfig:
    """Llama / Mistral / Qwen2 / Qwen3 geometry and options (one module serves them all)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v projections
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: Optional[int] = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "DecoderConfig":
        """Read an HF config dict; unknown or unsupported options raise `UnsupportedModelError`."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise UnsupportedModelError("config.json has no 'architectures' entry")
        arch = archs[0]
        cfg = {**HF_CLASS_DEFAULTS.get(arch, {}), **cfg}
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (only 'silu')")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        is_qwen2 = arch.startswith("Qwen2")
        attention_bias = bool(cfg.get("attention_bias") or False)
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta") or 10000.0)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = cfg.get("sliding_window") if arch.startswith(WINDOWED_ARCHITECTURES) else None
        if is_qwen2 or arch.startswith("Qwen3"):
            window = window if cfg.get("use_sliding_window") else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias") or False),
            qk_norm=arch.startswith("Qwen3"),
            rope=rope,
            eos_token_ids=eos_ids,
            sliding_window=window,
            raw=dict(cfg),
        )

    def check_max_model_len(self, max_model_len: int) -> None:
        """Any length: layers with a `sliding_window` attend through it (`layer_window`)."""

    def layer_window(self, layer: int) -> int:
        """Keys a query of layer `layer` sees (its own included); 0 for full attention. Mistral windows every
        layer; Qwen2 / Qwen3 (`use_sliding_window`) the layers its `layer_types` mark, else those from
        `max_window_layers` on, as HF's config classes do."""
        if not self.sliding_window:
            return 0
        layer_types = self.raw.get("layer_types")
        if layer_types:
            return int(self.sliding_window) if layer_types[layer] == "sliding_attention" else 0
        if self.architecture.startswith(("Qwen2", "Qwen3")) and layer < self.raw.get("max_window_layers", 28):
            return 0
        return int(self.sliding_window)

    def rope_inv_freq(self) -> torch.Tensor:
        """[head_dim // 2] float32 inverse frequencies for RoPE (default, linear or llama3 scaling)."""
        theta = float(self.rope["rope_theta"])
        kind = self.rope.get("rope_type", "default")
        # On the CPU even inside a meta-device build: meta arange goes through torch._refs, which imports dynamo
        # (and makes its cache directory under TMPDIR); the caller moves the few values where it needs them.
        arange = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device="cpu")
        inv = 1.0 / (theta ** (arange / self.head_dim))
        if kind == "default":
            pass
        elif kind == "linear":
            inv = inv / float(self.rope["factor"])
        elif kind == "llama3":
            factor = float(self.rope["factor"])
            low, high = float(self.rope["low_freq_factor"]), float(self.rope["high_freq_factor"])
            old_len = float(self.rope["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv
            smooth = (old_len / wavelen - low) / (high - low)
            scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
            mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
            inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        else:
            raise UnsupportedModelError(
                f"rope_scaling / rope_parameters: rope_type={kind!r} is not supported (default, linear, llama3)"
            )
        return inv.float()


# Multimodal checkpoints whose text model mrv2 runs: architecture -> the text-only architecture it loads as.
TEXT_MODEL_OF = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config (`TEXT_MODEL_OF`) as its text model's: `text_config`'s keys on top, the text-only
    architecture, and `text_weights_prefix` (where the checkpoint keeps the text weights); others unchanged."""
    arch = (cfg.get("architectures") or [None])[0]
    text = cfg.get("text_config")
    if arch not in TEXT_MODEL_OF or not isinstance(text, dict):
        return cfg
    return {**cfg, **text, "architectures": [TEXT_MODEL_OF[arch]], "text_weights_prefix": "model.language_model."}
