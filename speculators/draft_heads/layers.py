"""Building blocks of the draft heads: one decoder layer whose attention is a pluggable `attend` function.

The same parameters serve two forwards. A full-sequence forward (`causal_attend`: dense causal attention over
`[B, N]` tokens, no cache) is what training and the test references use; a paged forward (`paged_attend`:
store K/V into a paged cache layer, then the engine's paged attention) is what the speculator runs on the
device. Parameter names follow the HF decoder layer (`self_attn.q_proj`, `mlp.gate_proj`, ...), so
checkpoints load by name.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from framework.layers.attention import AttentionMetadata
from framework.layers.attention.backend import paged_attention, store_kv
from framework.models.hf_config import DecoderConfig
from framework.models.llama import MLP, RMSNorm

# q [..., N, Hq, D], k / v [..., N, Hkv, D] -> [..., N, Hq, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_attend(scale: float) -> Attend:
    """Dense causal attention over whole sequences `[B, N, heads, D]` (GQA by repeating K/V heads)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[-2] // k.shape[-2]
        q_, k_, v_ = (t.transpose(-3, -2) for t in (q, k, v))  # [B, heads, N, D]
        k_, v_ = k_.repeat_interleave(group, dim=-3), v_.repeat_interleave(group, dim=-3)
        scores = (q_.float() @ k_.float().transpose(-1, -2)) * scale  # [B, Hq, N, N]
        n = q.shape[-3]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        return (probs @ v_.float()).to(q.dtype).transpose(-3, -2)

    return attend


def paged_attend(kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, backend: str = "auto") -> Attend:
    """Flattened tokens `[T, heads, D]`: store K/V at `meta.kv_slot_mapping`, attend over the paged cache."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.kv_slot_mapping, backend=backend)
        return paged_attention(q, kv_cache, meta, scale, backend=backend)

    return attend


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., N] -> cos, sin [..., N, D] (half-split RoPE, as the target model computes it)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class HeadAttention(nn.Module):
    """Self-attention of a draft layer; `in_features` is 2H for EAGLE-3 (embedding and hidden concatenated)."""

    def __init__(self, cfg: DecoderConfig, in_features: int, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_features, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(in_features, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(in_features, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attend(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
        return self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))


class HeadDecoderLayer(nn.Module):
    """A pre-norm decoder layer of the target family (`input_layernorm` optional: EAGLE-1 layer 0 has none)."""

    def __init__(self, cfg: DecoderConfig, input_norm: bool = True) -> None:
        super().__init__()
        if input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.has_input_norm = input_norm
        self.self_attn = HeadAttention(cfg, cfg.hidden_size, cfg.qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        normed = self.input_layernorm(x) if self.has_input_norm else x
        x = x + self.self_attn(normed, cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")


def family_of(architecture: str) -> Optional[str]:
    """'EagleQwen3ForCausalLM' / 'Qwen3ForCausalLM' / 'LlamaForCausalLMEagle3' -> 'Qwen3' / 'Llama' (or None)."""
    name = architecture.replace("Eagle3", "").replace("Eagle", "")
    for family in FAMILIES:
        if name.startswith(family):
            return family
    return None


def decoder_config(config: dict[str, Any], family: str) -> DecoderConfig:
    """The geometry of a draft layer: the head's config.json read as a decoder of `family`."""
    return DecoderConfig.from_hf({**config, "architectures": [f"{family}ForCausalLM"]})
