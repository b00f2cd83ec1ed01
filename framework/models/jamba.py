"""Jamba (single expert): Mamba-1 layers interleaved with attention layers that use no positional encoding.

Layer `i` is attention when `i % attn_layer_period == attn_layer_offset`, Mamba otherwise; every layer is
followed by a dense SiLU MLP (`num_experts = 1`; mixture-of-experts checkpoints are refused). Parameter names
match HF's `JambaForCausalLM`, so safetensors weights load by name. Attention layers use the paged KV cache;
Mamba layers keep their conv and SSM state in request slots owned by `MambaHybridModelState`
(`model_state_name = "mamba_hybrid"`), which passes this step's views as the `mamba` forward input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from framework.layers.attention import AttentionMetadata
from framework.layers.attention.backend import paged_attention, store_kv
from framework.models.hf_config import UnsupportedModelError
from framework.models.interface import MambaHybrid, Model
from framework.models.llama import RMSNorm
from framework.models.mamba_layer import MambaMixer, MambaStepInputs


@dataclass(frozen=True)
class JambaConfig:
    """The Jamba geometry mrv2 reads from an HF `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attn_layer_period: int
    attn_layer_offset: int
    d_state: int
    d_conv: int
    d_inner: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "JambaConfig":
        """Read an HF Jamba config dict; options mrv2 cannot run raise `UnsupportedModelError`."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (only 'silu')")
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 16)))
        if num_experts != 1:
            raise UnsupportedModelError(
                f"Jamba with num_experts={num_experts} is not supported: mrv2 runs the "
                "single-expert (dense MLP) variant only"
            )
        period, offset = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
        if not 0 <= offset < period:
            raise UnsupportedModelError(f"attn_layer_offset={offset} must be in [0, attn_layer_period={period})")
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        dt_rank = cfg.get("mamba_dt_rank", "auto")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_layer_period=period,
            attn_layer_offset=offset,
            d_state=cfg.get("mamba_d_state", 16),
            d_conv=cfg.get("mamba_d_conv", 4),
            d_inner=cfg.get("mamba_expand", 2) * hidden,
            dt_rank=math.ceil(hidden / 16) if dt_rank == "auto" else int(dt_rank),
            conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        )

    def is_attention(self, layer: int) -> bool:
        return layer % self.attn_layer_period == self.attn_layer_offset


class JambaAttention(nn.Module):
    """Causal self-attention on the paged KV cache, without positional encoding."""

    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        store_kv(k, v, kv_cache, meta.kv_slot_mapping, backend=self.kernel_backend)
        out = paged_attention(q, kv_cache, meta, self.scale, backend=self.kernel_backend)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class JambaMLP(nn.Module):
    """SiLU-gated MLP (the single expert)."""

    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class JambaLayer(nn.Module):
    """Pre-norm mixer (attention or Mamba) and pre-norm MLP, each with a residual."""

    def __init__(self, cfg: JambaConfig, attention: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if attention:
            self.self_attn = JambaAttention(cfg)
        else:
            self.mamba = MambaMixer(
                cfg.hidden_size,
                cfg.d_inner,
                cfg.d_state,
                cfg.d_conv,
                cfg.dt_rank,
                cfg.rms_norm_eps,
                cfg.conv_bias,
                cfg.proj_bias,
            )
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = JambaMLP(cfg)


class JambaModel(nn.Module):
    """Embeddings, the layer stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(JambaLayer(cfg, cfg.is_attention(i)) for i in range(cfg.num_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class JambaForCausalLM(Model, MambaHybrid):
    """Jamba causal LM: attention layers on the paged KV cache, Mamba layers on per-slot recurrent state."""

    waits_per_kv_layer = True  # the forward waits for each paged layer's KV-tier loads (Model)

    model_state_name = "mamba_hybrid"

    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = JambaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention_layers = [i for i in range(cfg.num_layers) if cfg.is_attention(i)]
        self.mamba_layers = [i for i in range(cfg.num_layers) if not cfg.is_attention(i)]

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "JambaForCausalLM":
        """Build (uninitialised) from an HF config dict."""
        return cls(JambaConfig.from_hf(hf_config))

    @property
    def num_kv_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def kv_heads(self) -> int:
        return self.config.num_kv_heads

    @property
    def kv_head_dim(self) -> int:
        return self.config.head_dim

    def shareable_embeddings(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        return self.model.embed_tokens.weight, self.lm_head.weight

    def mamba_state_shapes(self) -> tuple[int, tuple[int, int], tuple[int, int]]:
        """(number of Mamba layers, per-slot conv state shape, per-slot SSM state shape)."""
        c = self.config
        return len(self.mamba_layers), (c.d_inner, c.d_conv - 1), (c.d_inner, c.d_state)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64 (unused: Jamba's attention has no positional encoding)
        kv_caches: list[torch.Tensor],  # one per attention layer
        attn_metadata: AttentionMetadata,
        mamba: MambaStepInputs,
    ) -> torch.Tensor:
        """[T, hidden] final hidden states."""
        x = self.model.embed_tokens(input_ids)
        kv_iter, state_iter = enumerate(kv_caches), iter(mamba.layers)
        for layer in self.model.layers:
            h = layer.input_layernorm(x)
            if hasattr(layer, "self_attn"):
                kv_layer, kv_cache = next(kv_iter)
                attn_metadata.kv_waits.layer(kv_layer)  # a KV tier's loads of this layer are in place (no-op without)
                x = x + layer.self_attn(h, kv_cache, attn_metadata)
            else:
                x = x + layer.mamba(h, next(state_iter), mamba)
            x = x + layer.feed_forward(layer.pre_ff_layernorm(x))
        return self.model.final_layernorm(x)
