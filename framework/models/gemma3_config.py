"""The Gemma 3 text geometry mrv2 reads from an HF `config.json`: per-layer attention kinds and RoPE bases,
`query_pre_attn_scalar`, GELU-tanh, soft-capping."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from framework.models.hf_config import DecoderConfig, UnsupportedModelError

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # HF's names of tanh-approximated GELU

# What HF's `Gemma3TextConfig` assumes for keys a config.json leaves out.
GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0


def _layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """`layer_types`, else every `sliding_window_pattern`-th layer full (HF's rule; the pattern defaults to 6)."""
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    kinds = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {SLIDING, FULL}:
        raise UnsupportedModelError(f"layer_types={list(kinds)} must name {num_layers} of {SLIDING}/{FULL}")
    return tuple(kinds)


def _rope_by_kind(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full layers' RoPE, sliding layers' RoPE) from `rope_parameters` per layer kind (transformers 5) or the
    older `rope_theta` + `rope_scaling` (global layers) and `rope_local_base_freq` (window layers)."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full = dict(params or cfg.get("rope_scaling") or {})
        local = {}
    full.setdefault("rope_theta", cfg.get("rope_theta") or GLOBAL_THETA)
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq") or LOCAL_THETA)
    for rope in (full, local):
        rope.setdefault("rope_type", rope.pop("type", "default"))
    return full, local


@dataclass(frozen=True)
class Gemma3Config(DecoderConfig):
    """Gemma 3's text model: `rope` is the full layers' RoPE, `rope_local` the window layers'; attention scaled by
    `query_pre_attn_scalar ** -0.5`; `final_logit_softcap` (0: none) caps the logits as `c * tanh(x / c)`."""

    layer_types: tuple[str, ...] = ()
    rope_local: dict[str, Any] = dataclasses.field(default_factory=dict)
    query_pre_attn_scalar: float = 256.0
    final_logit_softcap: float = 0.0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma3Config":
        """Read an HF Gemma 3 text config (or a multimodal one's `text_config`, merged by the loader); options the
        kernels cannot serve are refused by name."""
        cfg = {**GEMMA3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        act = cfg.get("hidden_activation") or cfg.get("hidden_act")
        if act not in GELU_TANH:
            raise UnsupportedModelError(f"hidden_activation={act!r} is not supported (Gemma 3: 'gelu_pytorch_tanh')")
        if cfg.get("attn_logit_softcapping"):
            raise UnsupportedModelError(
                f"attn_logit_softcapping={cfg['attn_logit_softcapping']}: the attention kernels have no logit "
                "soft-capping (Gemma 3's released configs set it to null)"
            )
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention=true (an embedding model) is not supported")
        full, local = _rope_by_kind(cfg)
        base = super().from_hf({**cfg, "hidden_act": "silu", "sliding_window": None, "rope_parameters": full})
        kinds = _layer_types(cfg, base.num_layers)
        window = cfg.get("sliding_window")
        if SLIDING in kinds and not (isinstance(window, int) and window > 0):
            raise UnsupportedModelError(f"sliding_window={window!r} must be a positive int for sliding layers")
        cap = cfg.get("final_logit_softcapping")
        return dataclasses.replace(
            base,
            qk_norm=True,
            sliding_window=window if SLIDING in kinds else None,
            layer_types=kinds,
            rope_local=local,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
            final_logit_softcap=float(cap or 0.0),
        )

    def layer_window(self, layer: int) -> int:
        """Keys a query of layer `layer` sees (its own included); 0 for a full-attention layer."""
        return int(self.sliding_window or 0) if self.layer_types[layer] == SLIDING else 0

    def check_max_model_len(self, max_model_len: int) -> None:
        """Any length: window layers attend through their window."""

    def local_rope_inv_freq(self) -> torch.Tensor:
        """[head_dim // 2] float32: the window layers' inverse frequencies (`rope_local`)."""
        return dataclasses.replace(self, rope=self.rope_local).rope_inv_freq()

    @property
    def embed_scale(self) -> float:
        """The factor on the token embeddings: sqrt(hidden_size)."""
        return float(self.hidden_size) ** 0.5

    def softcap(self) -> Optional[float]:
        """The final logit soft-cap, None when the config has none."""
        return self.final_logit_softcap or None
