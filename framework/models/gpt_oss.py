"""gpt-oss (`GptOssForCausalLM`): the dense decoder's attention with learned sinks, alternating sliding-window and
full layers, and a top-k MoE whose experts carry biases and a clamped SwiGLU.

Parameter names are the HF checkpoint's (`mlp.router`, `mlp.experts.gate_up_proj [E, H, 2I]` with gate and up
interleaved column by column, `mlp.experts.down_proj [E, I, H]`, their `_bias`, `self_attn.sinks [H]`), so weights
load by name. The experts run in PyTorch (the fused MoE kernel has no biases or clamped activation yet): every
expert densely for small batches, each routed expert over its tokens for large ones. MXFP4 expert weights are
refused by `GptOssConfig.from_hf`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import SINGLE
from framework.models.gpt_oss_config import GptOssConfig
from framework.models.llama import Attention, LlamaForCausalLM, RMSNorm

# Forwards of at most this many tokens run every expert densely (graph-safe: no host read of the routing).
DENSE_MAX_TOKENS = 256


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] (gate, up interleaved) -> [N, I]: `(clamp(up) + 1) * g * sigmoid(alpha * g)`, g = gate clamped
    from above at `limit`, up to [-limit, limit]."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    """All experts of one layer, in the checkpoint's layout."""

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] routing weights
        ids: torch.Tensor,  # [T, k] int64 expert ids
    ) -> torch.Tensor:  # [T, H]
        """Small batches (decode) and any CUDA-graph capture run every expert over every token, weighted by its
        routing weight (0 where not routed): no host read. Larger eager batches run each routed expert over its
        tokens only."""
        out = torch.zeros_like(x)
        if x.shape[0] <= DENSE_MAX_TOKENS or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            for expert in range(self.gate_up_proj.shape[0]):
                weight = (weights * (ids == expert)).sum(dim=-1, keepdim=True)  # [T, 1]
                out += (self._expert(x, expert) * weight).to(x.dtype)
            return out
        for expert in torch.unique(ids).tolist():
            token, slot = torch.where(ids == expert)
            out.index_add_(0, token, (self._expert(x[token], expert) * weights[token, slot, None]).to(x.dtype))
        return out

    def _expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:  # [N, H] -> [N, H]
        h = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        return clamped_swiglu(h, self.alpha, self.limit) @ self.down_proj[expert] + self.down_proj_bias[expert]


class GptOssMoe(nn.Module):
    """Router (a biased linear; softmax over the top-k logits) and the experts: [T, H] -> [T, H]."""

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        return self.experts(x, torch.softmax(top, dim=-1), ids)


class GptOssDecoderLayer(nn.Module):
    """Norm, attention with sinks over this layer's window (0: full), norm, MoE."""

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ctx)
        self.self_attn.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoe(cfg)
        self.window = cfg.layer_window(layer)

    def forward(self, x, residual, cos, sin, kv_cache, meta, attention):  # type: ignore[no-untyped-def]
        """(this layer's MLP output, the residual stream before it is added), as `DecoderLayer.forward`."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn
        qkv = (
            F.linear(h, attn.qkv_weight, attn.qkv_bias)
            if attn.qkv_weight is not None
            else torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
        )
        q = attn.rope_store(qkv, cos, sin, kv_cache, meta.kv_slot_mapping)
        o = attention(q, kv_cache, meta, attn.scale, window=self.window, sinks=attn.sinks.float())
        h = attn.o_proj(o.reshape(o.shape[0], -1))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


def _make_layer(cfg: GptOssConfig, ctx: ParallelContext, layer: int) -> nn.Module:
    return GptOssDecoderLayer(cfg, ctx, layer)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss causal LM over the paged KV cache (interface of `LlamaForCausalLM`); one rank, bf16 experts."""

    supports_parallel = supports_quantization = False
    config_cls = GptOssConfig
    make_layer = staticmethod(_make_layer)

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext = SINGLE) -> None:  # type: ignore[override]
        super().__init__(cfg, ctx)
        self.attention_factor = cfg.rope_attention_factor()

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin, scaled by YaRN's attention factor as HF does."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
