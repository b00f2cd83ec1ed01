"""The Gemma 4 text geometry mrv2 reads from an HF `config.json` (transformers' `Gemma4TextConfig`): per-layer-kind
head geometry and RoPE, key/value sharing between layers, per-layer input embeddings, the MoE block."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from framework.models.gemma3_config import FULL, GELU_TANH, SLIDING
from framework.models.hf_config import DecoderConfig, UnsupportedModelError

# What HF's `Gemma4TextConfig` assumes for keys a config.json leaves out.
GEMMA4_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "pad_token_id": 0,
}
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
GLOBAL_HEAD_DIM = 512  # HF's `global_head_dim` when neither it nor `per_layer_config` is given
# Gemma4Config's placeholder token ids (images, videos, audio): a multimodal checkpoint's text model embeds them as
# `pad_token_id` (HF's Gemma4Model does, with or without media inputs).
PLACEHOLDER_DEFAULTS = {"image_token_id": 258_880, "video_token_id": 258_884, "audio_token_id": 258_881}
PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}  # what a `per_layer_config` entry may override


def _layer_types(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """`layer_types`, else every sixth layer full; the last layer is full whatever the config says (HF forces it)."""
    kinds = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)])
    if len(kinds) != num_layers or set(kinds) - {SLIDING, FULL}:
        raise UnsupportedModelError(f"layer_types={kinds} must name {num_layers} of {SLIDING}/{FULL}")
    kinds[-1] = FULL
    return kinds


def _kind_geometry(cfg: dict[str, Any], kinds: list[str]) -> dict[str, tuple[int, int]]:
    """(kv heads, head_dim) per layer kind: the window layers take the config's; the full layers `per_layer_config`'s
    overrides (what transformers writes) or `global_head_dim` (512) and, with `attention_k_eq_v`,
    `num_global_key_value_heads`, as HF's config builds them."""
    sliding = (int(cfg["num_key_value_heads"] or cfg["num_attention_heads"]), int(cfg["head_dim"]))
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        kv_heads = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        override = {"head_dim": cfg.get("global_head_dim") or GLOBAL_HEAD_DIM}
        if kv_heads:
            override["num_key_value_heads"] = kv_heads
        per_layer = {i: override for i, kind in enumerate(kinds) if kind == FULL}
    per_layer = {int(i): dict(v or {}) for i, v in per_layer.items()}
    geometry: dict[str, set[tuple[int, int]]] = {}
    for i, kind in enumerate(kinds):
        over = per_layer.get(i, {})
        if set(over) - PER_LAYER_KEYS:
            raise UnsupportedModelError(
                f"per_layer_config[{i}] overrides {sorted(set(over) - PER_LAYER_KEYS)}: mrv2 reads only "
                f"{sorted(PER_LAYER_KEYS)} per layer"
            )
        kv, dim = int(over.get("num_key_value_heads", sliding[0])), int(over.get("head_dim", sliding[1]))
        geometry.setdefault(kind, set()).add((kv, dim))
    if any(len(g) > 1 for g in geometry.values()):
        raise UnsupportedModelError(f"per_layer_config gives layers of one kind different head geometries: {geometry}")
    return {kind: next(iter(g)) for kind, g in geometry.items()}


def _rope_by_kind(cfg: dict[str, Any], kinds: list[str]) -> dict[str, dict[str, Any]]:
    """Each layer kind's RoPE from `rope_parameters` (nested by kind; HF's defaults when absent)."""
    params = cfg.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(params, dict) or not set(kinds) <= set(params):
        raise UnsupportedModelError(
            f"rope_parameters={params!r} must hold one entry per layer kind ({', '.join(sorted(set(kinds)))})"
        )
    ropes: dict[str, dict[str, Any]] = {}
    for kind in set(kinds):
        rope = dict(params[kind] or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", 10_000.0)
        if rope["rope_type"] not in ("default", "proportional"):
            raise UnsupportedModelError(
                f"rope_parameters[{kind!r}].rope_type={rope['rope_type']!r} is not supported (default, proportional)"
            )
        ropes[kind] = rope
    return ropes


def _kv_sources(kinds: list[str], num_shared: int) -> tuple[int, ...]:
    """Per layer, the layer whose keys and values it attends over: itself, or for the last `num_shared` layers the
    last layer of its kind before them (HF's `kv_sharing_modes`: that layer "stores", these "reuse")."""
    num_layers = len(kinds)
    if not 0 <= num_shared < num_layers:
        raise UnsupportedModelError(
            f"num_kv_shared_layers={num_shared} must be in 0..num_hidden_layers - 1 ({num_layers - 1}): some layer "
            "must compute the keys and values the others share"
        )
    first_shared = num_layers - num_shared
    sources = list(range(num_layers))
    for i in range(first_shared, num_layers):
        producers = [j for j in range(first_shared) if kinds[j] == kinds[i]]
        if not producers:
            raise UnsupportedModelError(
                f"num_kv_shared_layers={num_shared}: shared layer {i} ({kinds[i]}) has no earlier {kinds[i]} layer "
                "to take its keys and values from"
            )
        sources[i] = producers[-1]
    return tuple(sources)


@dataclass(frozen=True)
class Gemma4Config(DecoderConfig):
    """Gemma 4's text model. `num_kv_heads` / `head_dim` are the window layers'; the full layers' are
    `full_kv_heads` / `full_head_dim`. `kv_sources[i]` is the layer whose KV cache layer `i` reads (itself except in
    the shared tail). `per_layer_dim` (0: none) sizes the per-layer input embeddings; `num_experts` (0: none) the MoE
    block beside each MLP; `final_logit_softcap` (0: none) caps the logits as `c * tanh(x / c)`."""

    layer_types: tuple[str, ...] = ()
    full_kv_heads: int = 0
    full_head_dim: int = 0
    k_eq_v: bool = False  # full layers: the value is the key projection (no v_proj), normed on its own
    rope_by_kind: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    kv_sources: tuple[int, ...] = ()
    double_wide_mlp: bool = False  # the shared layers' MLPs are twice `intermediate_size`
    per_layer_dim: int = 0
    per_layer_vocab_size: int = 0
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcap: float = 0.0
    pad_token_id: int = 0
    placeholder_token_ids: tuple[int, ...] = ()  # embedded as `pad_token_id` (multimodal checkpoints)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma4Config":
        """Read an HF Gemma 4 text config (or a multimodal one's `text_config`, merged by the loader); options mrv2
        cannot run are refused by name."""
        multimodal = bool(cfg.get("text_weights_prefix"))
        cfg = {**GEMMA4_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        act = cfg.get("hidden_activation") or cfg.get("hidden_act")
        if act not in GELU_TANH:
            raise UnsupportedModelError(f"hidden_activation={act!r} is not supported (Gemma 4: 'gelu_pytorch_tanh')")
        if cfg.get("use_bidirectional_attention") == "all":
            raise UnsupportedModelError("use_bidirectional_attention='all' (an embedding model) is not supported")
        base = super().from_hf({**cfg, "hidden_act": "silu", "sliding_window": None, "rope_parameters": None})
        kinds = _layer_types(cfg, base.num_layers)
        geometry = _kind_geometry(cfg, kinds)
        ropes = _rope_by_kind(cfg, kinds)
        window = cfg.get("sliding_window")
        if SLIDING in kinds and not (isinstance(window, int) and window > 0):
            raise UnsupportedModelError(f"sliding_window={window!r} must be a positive int for sliding layers")
        for kind, (kv_heads, _) in geometry.items():
            if base.num_heads % kv_heads:
                raise UnsupportedModelError(
                    f"num_attention_heads={base.num_heads} is not a multiple of the {kind} layers' {kv_heads} KV heads"
                )
        num_experts = int(cfg.get("num_experts") or 0) if cfg.get("enable_moe_block") else 0
        top_k = int(cfg.get("top_k_experts") or 0)
        moe_inter = int(cfg.get("moe_intermediate_size") or 0)
        if num_experts and not (1 <= top_k <= num_experts and moe_inter > 0):
            raise UnsupportedModelError(
                f"enable_moe_block: top_k_experts={top_k} must be in 1..num_experts={num_experts} and "
                f"moe_intermediate_size={moe_inter} positive"
            )
        if cfg.get("enable_moe_block") and not num_experts:
            raise UnsupportedModelError("enable_moe_block=true needs num_experts")
        cap = cfg.get("final_logit_softcapping")
        sliding_geo = geometry.get(SLIDING, (base.num_kv_heads, base.head_dim))
        full_geo = geometry.get(FULL, sliding_geo)
        placeholders = tuple(int(cfg.get(k) or v) for k, v in PLACEHOLDER_DEFAULTS.items()) if multimodal else ()
        return dataclasses.replace(
            base,
            num_kv_heads=sliding_geo[0],
            head_dim=sliding_geo[1],
            qk_norm=True,
            rope={"rope_type": "default", "rope_theta": float(ropes.get(SLIDING, ropes[FULL])["rope_theta"])},
            sliding_window=window if SLIDING in kinds else None,
            layer_types=tuple(kinds),
            full_kv_heads=full_geo[0],
            full_head_dim=full_geo[1],
            k_eq_v=bool(cfg.get("attention_k_eq_v")),
            rope_by_kind=ropes,
            kv_sources=_kv_sources(kinds, int(cfg.get("num_kv_shared_layers") or 0)),
            double_wide_mlp=bool(cfg.get("use_double_wide_mlp")),
            per_layer_dim=int(cfg.get("hidden_size_per_layer_input") or 0),
            per_layer_vocab_size=int(cfg["vocab_size_per_layer_input"]),
            num_experts=num_experts,
            top_k_experts=top_k,
            moe_intermediate_size=moe_inter,
            final_logit_softcap=float(cap or 0.0),
            pad_token_id=int(cfg["pad_token_id"]),
            placeholder_token_ids=placeholders,
        )

    # ---- per layer -------------------------------------------------------------------------------------------
    def layer_window(self, layer: int) -> int:
        """Keys a query of layer `layer` sees (its own included); 0 for a full-attention layer."""
        return int(self.sliding_window or 0) if self.layer_types[layer] == SLIDING else 0

    def layer_geometry(self, layer: int, tp_size: int = 1) -> tuple[int, int]:
        """(KV heads, head_dim) of layer `layer`'s attention; the KV heads of one of `tp_size` tensor ranks."""
        if self.layer_types[layer] == FULL:
            return self.full_kv_heads // tp_size, self.full_head_dim
        return self.num_kv_heads // tp_size, self.head_dim

    def is_kv_shared(self, layer: int) -> bool:
        """Whether layer `layer` reads another layer's keys and values (and has no k/v projections of its own)."""
        return self.kv_sources[layer] != layer

    def layer_k_eq_v(self, layer: int) -> bool:
        """Whether layer `layer`'s values are its key projection (`attention_k_eq_v`, full layers)."""
        return self.k_eq_v and self.layer_types[layer] == FULL

    def layer_intermediate_size(self, layer: int) -> int:
        """The MLP width of layer `layer` (doubled on the shared layers with `use_double_wide_mlp`)."""
        return self.intermediate_size * (2 if self.double_wide_mlp and self.is_kv_shared(layer) else 1)

    def attention_config(self, layer: int) -> DecoderConfig:
        """This config with layer `layer`'s KV heads and head_dim, to build its projections."""
        kv_heads, head_dim = self.layer_geometry(layer)
        return dataclasses.replace(self, num_kv_heads=kv_heads, head_dim=head_dim)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that compute and store keys and values, in the order of the model's KV caches."""
        return tuple(i for i in range(self.num_layers) if not self.is_kv_shared(i))

    def kv_row_width(self, tp_size: int = 1) -> tuple[int, int]:
        """(heads, head_dim) of one token's row in the KV tensors (of one of `tp_size` tensor ranks): wide enough
        for every KV layer's K (or V), each layer viewing its first `kv_heads * head_dim` values (`gcd` of the
        layers' widths as the head_dim)."""
        widths = [math.prod(self.layer_geometry(i, tp_size)) for i in self.kv_layers]
        unit = math.gcd(*widths)
        return max(widths) // unit, unit

    def check_max_model_len(self, max_model_len: int) -> None:
        """Any length: window layers attend through their window."""

    def kind_inv_freq(self, kind: str) -> torch.Tensor:
        """[head_dim // 2] float32 inverse frequencies of the `kind` layers, computed as HF does (in float32).
        `proportional`: the first `partial_rotary_factor * head_dim / 2` pairs turn (their exponent over the whole
        head_dim), the rest are zero (an identity rotation), all divided by `factor`."""
        rope = self.rope_by_kind[kind]
        dim = self.full_head_dim if kind == FULL else self.head_dim
        theta = float(rope["rope_theta"])
        if rope["rope_type"] == "default":  # Gemma 4's default RoPE turns every pair (no partial factor)
            return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        turning = int(float(rope.get("partial_rotary_factor", 1.0)) * dim // 2)
        exps = torch.arange(0, 2 * turning, 2, dtype=torch.int64, device="cpu").float() / dim
        inv = torch.cat([1.0 / (theta**exps), torch.zeros(dim // 2 - turning, device="cpu")])
        return inv / float(rope.get("factor", 1.0))

    def softcap(self) -> Optional[float]:
        """The final logit soft-cap, None when the config has none."""
        return self.final_logit_softcap or None
