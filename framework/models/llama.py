"""Decoder-only transformer for the Llama, Mistral, Qwen2 and Qwen3 families, on the paged KV cache.

Parameter names match the HF checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...), so weights load
by name. Tokens of all requests are flattened into one `[T]` batch; attention reads and writes the paged cache.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from framework.attention import AttentionMetadata
from framework.attention.backend import paged_attention, store_kv
from framework.distributed.context import ParallelContext, stage_layers
from framework.models.hf_config import DecoderConfig
from framework.models.parallel_layers import (
    SINGLE, ColumnParallelLinear, MissingLayer, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
)

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
    """Self-attention over the paged cache; under tensor parallelism this rank's heads and KV heads only."""

    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        tp = ctx.tp_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.qkv_bias, ctx)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, ctx)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, ctx)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, ctx)
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
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ctx)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ctx)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ctx)

    def forward(self, x, cos, sin, kv_cache, meta, attention):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, layers and final norm; a pipeline stage builds only its layers (and the embedding on the first
    stage, the norm on the last), the others are `MissingLayer`s so that names keep their indices."""

    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.stage_layers = stage_layers(cfg.num_layers, ctx.pp_rank, ctx.pp_size)
        if ctx.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ctx) if i in self.stage_layers else MissingLayer()
                                    for i in range(cfg.num_layers))
        if ctx.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over the paged KV cache.

    `forward` returns hidden states `[T, hidden]`; `compute_logits` turns the rows that are sampled into
    float32 logits `[L, vocab]`. Under parallelism (`ctx`) this rank holds its heads, its MLP columns and its
    vocabulary rows of its pipeline stage's layers only.
    """

    supports_parallel = True

    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config, self.ctx = cfg, ctx
        self.model = DecoderModel(cfg, ctx)
        # A stage without the embedding loads a tied LM head from the embedding's checkpoint tensor.
        self.checkpoint_aliases: dict[str, str] = {}
        if ctx.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx)
            if cfg.tie_word_embeddings and ctx.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight
            elif cfg.tie_word_embeddings:
                self.checkpoint_aliases["lm_head.weight"] = "model.embed_tokens.weight"
        self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)
        self.attention: AttentionFn = paged_attention

    @classmethod
    def from_hf_config(cls, hf_config: dict, ctx: ParallelContext = SINGLE) -> "LlamaForCausalLM":
        """Build (uninitialised) from an HF config dict, this rank's part of it under parallelism."""
        return cls(DecoderConfig.from_hf(hf_config), ctx)

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """False for tensors of other pipeline stages (the loader skips them without reading)."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.model.stage_layers
        if name.startswith("model.embed_tokens."):
            return self.ctx.is_first_stage or (self.ctx.is_last_stage and self.config.tie_word_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.ctx.is_last_stage
        return True

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's paged KV cache (this rank's KV heads)."""
        return (2, num_blocks, block_size, self.config.num_kv_heads // self.ctx.tp_size, self.config.head_dim)

    @property
    def num_kv_layers(self) -> int:
        return len(self.model.stage_layers)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        pp_hidden: Optional[torch.Tensor] = None,  # [T, hidden] from the previous pipeline stage
    ) -> torch.Tensor:
        """Hidden states after the final norm; a stage other than the last returns its layers' output instead."""
        return self.forward_with_aux(input_ids, positions, kv_caches, attn_metadata, pp_hidden=pp_hidden)[0]

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        aux_layer_ids: tuple[int, ...] = (),
        pp_hidden: Optional[torch.Tensor] = None,  # [T, hidden] from the previous pipeline stage
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(final hidden [T, hidden], the residual stream entering each layer of `aux_layer_ids` [T, hidden]).

        The aux states are the tensors the layer loop already holds (no copy), so asking for them costs
        nothing but keeping them alive; a CUDA graph captured over this method returns them as outputs.
        Layer ids are global; under pipeline parallelism only this stage's layers can be asked for.
        """
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        x = self.model.embed_tokens(input_ids) if pp_hidden is None else pp_hidden
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        stage = self.model.stage_layers
        entering: dict[int, torch.Tensor] = {}
        for i, kv_cache in zip(stage, kv_caches):
            if i in aux_layer_ids:
                entering[i] = x
            x = self.model.layers[i](x, cos, sin, kv_cache, attn_metadata, self.attention)
        return (self.model.norm(x) if self.ctx.is_last_stage else x), tuple(entering[i] for i in aux_layer_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[L, hidden] -> [L, vocab] float32."""
        return self.lm_head(hidden).float()

