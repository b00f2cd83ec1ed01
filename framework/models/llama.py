"""Decoder-only transformer for the Llama, Mistral, Qwen2 and Qwen3 families, on the paged KV cache.

Parameter names match the HF checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...), so weights load
by name. Tokens of all requests are flattened into one `[T]` batch; attention reads and writes the paged cache.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from framework.attention import AttentionMetadata
from framework.attention.backend import paged_attention, store_kv
from framework.models.hf_config import DecoderConfig

AttentionFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by half-split RoPE; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        attention: AttentionFn,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        store_kv(k, v, kv_cache, meta.kv_slot_mapping)
        out = attention(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_cache, meta, attention):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over the paged KV cache.

    `forward` returns hidden states `[T, hidden]`; `compute_logits` turns the rows that are sampled into
    float32 logits `[L, vocab]`.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)
        self.attention: AttentionFn = paged_attention

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "LlamaForCausalLM":
        """Build (uninitialised) from an HF config dict."""
        return cls(DecoderConfig.from_hf(hf_config))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's paged KV cache."""
        return (2, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)

    @property
    def num_kv_layers(self) -> int:
        return self.config.num_layers

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.forward_with_aux(input_ids, positions, kv_caches, attn_metadata)[0]

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(final hidden [T, hidden], the residual stream entering each layer of `aux_layer_ids` [T, hidden]).

        The aux states are the tensors the layer loop already holds (no copy), so asking for them costs
        nothing but keeping them alive; a CUDA graph captured over this method returns them as outputs.
        """
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        x = self.model.embed_tokens(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        entering: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if i in aux_layer_ids:
                entering[i] = x
            x = layer(x, cos, sin, kv_cache, attn_metadata, self.attention)
        return self.model.norm(x), tuple(entering[i] for i in aux_layer_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[L, hidden] -> [L, vocab] float32."""
        return self.lm_head(hidden).float()

