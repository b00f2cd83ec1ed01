"""Gemma 4's decoder layer and its parts (`framework.models.gemma4` assembles the model).

Beyond Gemma 3's layer: norms scale by `weight` in float32 and round once (not `1 + weight`); values are RMS-normed
without a weight; attention logits are not scaled (the q/k norms set their size); a KV-shared layer projects
queries only and attends over its source layer's cache; `attention_k_eq_v` layers take the values from the key
projection; an optional top-k MoE (GELU-tanh experts in the fused MoE kernel) runs beside the MLP on the same
residual; the per-layer input is gated into the residual stream, and the layer's output is scaled by its
`layer_scalar`.

Under tensor parallelism a layer holds its rank's heads and KV heads of its kind's geometry (q/k/v column-parallel,
o_proj row-parallel), its MLP's and every expert's slice of the intermediate dim (the experts' partial sums
all-reduced before their norm); the router, the per-layer-input gate and projection and the norms are whole on
every rank (every rank routes identically).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch
from torch import nn
from torch.nn import functional as F

from framework.layers.attention import AttentionMetadata
from framework.layers.attention.qk_norm_rope import qk_norm_rope_store
from framework.layers.kernels.fused_moe import fused_moe
from framework.layers.kernels.layer_ops import apply_rope_reference, rms_norm
from framework.layers.kernels.moe_epilogue import GELU_TANH_EPILOGUE
from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import SINGLE
from framework.models.gemma3 import GemmaMLP, GemmaRMSNorm
from framework.models.gemma4_config import Gemma4Config
from framework.models.llama import Attention, AttentionFn
from framework.models.merge_rows import merge_rows
from framework.models.moe import StackedExperts


class Gemma4RMSNorm(GemmaRMSNorm):
    """RMSNorm scaling by `weight` in float32 and rounding once, as HF's Gemma 4 norm."""

    scale_mode: ClassVar[dict[str, bool]] = {"float32_scale": True}
    random_zeros: ClassVar[tuple[str, ...]] = ()  # not zero-centred: random weights set it to 1


class Gemma4Attention(Attention):
    """One layer's attention: q/k norms, values RMS-normed without a weight, unscaled logits; a KV-shared layer
    projects queries only and attends over its source layer's cache; `k_eq_v` layers take the values from the key
    projection."""

    def __init__(self, cfg: Gemma4Config, layer: int, ctx: ParallelContext = SINGLE) -> None:
        super().__init__(cfg.attention_config(layer), ctx)
        eps = cfg.rms_norm_eps
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.kv_shared = cfg.is_kv_shared(layer)
        self.k_eq_v = cfg.layer_k_eq_v(layer)
        del self.k_norm
        if self.kv_shared:  # HF builds no k/v projections or norms here: the source layer's cache is read
            del self.k_proj, self.v_proj
        else:
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            if self.k_eq_v:
                del self.v_proj
        self.eps = eps
        self.scale = 1.0
        # The value norm has no weight: the Llama-order norm with ones is HF's unscaled norm, rounded once.
        self.register_buffer("v_norm_weight", torch.ones(self.head_dim), persistent=False)

    def init_buffers(self) -> None:
        """The value norm's unit weight again (after a build on the meta device)."""
        self.v_norm_weight = torch.ones(self.head_dim)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]: this layer's (or its source's) view
        meta: AttentionMetadata,
        attention: AttentionFn,
    ) -> torch.Tensor:  # [T, hidden]
        if self.kv_shared:
            q = self.q_norm(self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim))
            q = apply_rope_reference(q, cos, sin)
        else:
            q = qk_norm_rope_store(
                self.project_qkv(x),
                cos,
                sin,
                self.q_norm.weight,
                self.k_norm.weight,
                self.eps,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                kv_cache,
                meta.kv_slot_mapping,
                backend=self.kernel_backend,
                float32_scale=True,
            )
        out = attention(q, kv_cache, meta, self.scale, window=self.window)
        return self.project_out(out.reshape(x.shape[0], self.num_heads * self.head_dim))

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, (H + 2 Hkv) * head_dim]
        """q, k and the normed v (the raw key projection for `k_eq_v`), as `qk_norm_rope_store` takes them."""
        if self.qkv_weight is not None:
            proj = F.linear(x, self.qkv_weight, self.qkv_bias)
        else:
            parts = [self.q_proj, self.k_proj] + ([] if self.k_eq_v else [self.v_proj])
            proj = torch.cat([p(x) for p in parts], dim=-1)
        q_cols, kv_cols = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        v = proj[:, q_cols : q_cols + kv_cols] if self.k_eq_v else proj[:, q_cols + kv_cols :]
        v = rms_norm(v.reshape(-1, self.head_dim), self.v_norm_weight, self.eps, backend=self.kernel_backend)[0]
        return torch.cat([proj[:, : q_cols + kv_cols], v.view(x.shape[0], kv_cols)], dim=-1)

    def fuse_projections(self) -> None:
        """q/k(/v) from one GEMM; a KV-shared layer has q alone, nothing to merge."""
        if not self.kv_shared:
            parts = [self.q_proj, self.k_proj] + ([] if self.k_eq_v else [self.v_proj])
            self.qkv_weight, self.qkv_bias = merge_rows(parts)


class Gemma4Router(nn.Module):
    """Top-k routing: RMS norm times `scale` and `hidden_size ** -0.5`, softmax over the experts in float32, the
    top k renormalised and scaled per expert (`per_expert_scale`)."""

    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.eps, self.top_k, self.root_size = cfg.rms_norm_eps, cfg.top_k_experts, cfg.hidden_size**-0.5
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> weights [T, K] f32, ids
        # HF rounds the unweighted norm, then multiplies by `scale` in dtype: the Llama-order norm does exactly that.
        h = rms_norm(x, self.scale, self.eps, backend=self.kernel_backend)[0] * self.root_size
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(StackedExperts):
    """All experts of one layer, stacked: `gate_up_proj [E, 2, I / tp, H]` (the checkpoint's `[E, 2I, H]`, gate
    first) and `down_proj [E, H, I / tp]`; GELU-tanh in the fused MoE kernel's epilogue; the ranks' partial sums
    all-reduced. Their quantized checkpoint layout is not known (`quant_formats` empty: refused by name)."""

    quant_formats: tuple[str, ...] = ()

    def __init__(self, cfg: Gemma4Config, ctx: ParallelContext = SINGLE) -> None:
        super().__init__(cfg, ctx)
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """[T, H] -> [T, H]: the experts of `ids` [T, top-k] weighted by `weights`, summed over the tensor ranks."""
        out = fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, self.kernel_backend, GELU_TANH_EPILOGUE)
        return self.ctx.tp_all_reduce(out)


class Gemma4DecoderLayer(nn.Module):
    """Norm, attention, norm, add; norm, MLP (+ the MoE beside it), norm, add; the per-layer input gated in; all
    times `layer_scalar`. Takes and returns the whole residual stream (the scalar scales all of it)."""

    # Random weights (`init_random_weights`) set it to 1: drawn at N(0, 0.02) it would shrink the residual stream
    # fifty-fold per layer.
    random_ones: ClassVar[tuple[str, ...]] = ("layer_scalar",)

    def __init__(self, cfg: Gemma4Config, layer: int, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(dim, eps)
        self.self_attn = Gemma4Attention(cfg, layer, ctx)
        self.post_attention_layernorm = Gemma4RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(dim, eps)
        self.mlp = GemmaMLP(dataclasses.replace(cfg, intermediate_size=cfg.layer_intermediate_size(layer)), ctx)
        self.post_feedforward_layernorm = Gemma4RMSNorm(dim, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # a buffer in HF, saved with the weights
        self.router: Optional[Gemma4Router] = None
        self.experts: Optional[Gemma4Experts] = None
        if cfg.num_experts:
            self.router, self.experts = Gemma4Router(cfg), Gemma4Experts(cfg, ctx)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(dim, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(dim, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(dim, eps)
        if cfg.per_layer_dim:
            self.per_layer_input_gate = nn.Linear(dim, cfg.per_layer_dim, bias=False)
            self.per_layer_projection = nn.Linear(cfg.per_layer_dim, dim, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the residual stream
        per_layer_input: Optional[torch.Tensor],  # [T, per_layer_dim] or None
        cos: torch.Tensor,  # [T, head_dim] of this layer's kind
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionFn,
    ) -> torch.Tensor:  # [T, hidden]
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, attention)
        h, x = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(h), x)
        out = self.mlp(h)
        if self.experts is not None:
            out = self.post_feedforward_layernorm_1(out) + self._experts(x)
        x = x + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE branch on the residual stream `x` (routed from it, normed apart from the MLP's input)."""
        assert self.router is not None and self.experts is not None
        weights, ids = self.router(x)
        return self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(x), weights, ids))
