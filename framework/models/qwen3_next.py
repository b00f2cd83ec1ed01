"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers interleaved with gated full-attention layers.

Layer types come from the config's `layer_types` (else every `full_attention_interval`-th layer is attention,
the others `linear_attention`). Attention layers are on the paged KV cache: per-head zero-centred q/k RMSNorm,
rotary embedding on the first `partial_rotary_factor` of each head, and an output gate (`q_proj` yields the
query and a sigmoid gate per head). Linear-attention layers are `GatedDeltaNet` mixers whose conv and recurrent
state live in request slots owned by `HybridRecurrentModelState` (forward input `gdn`). MLPs are dense, or
sparse MoE blocks with a sigmoid-gated shared expert where the config has experts (Qwen3-Next, Qwen3.5-MoE).
Norms are zero-centred (`x * (1 + w)`). Parameter names match HF, so safetensors weights load by name;
a multimodal checkpoint's `model.visual.*` tensors and the `mtp.*` heads are skipped (logged once).

Tensor parallelism (`ctx`) splits attention heads and KV heads, the Gated DeltaNet heads (`gdn_layer`), the MLP
columns, every expert's intermediate dimension (the router is replicated; `framework.models.moe`) and the
vocabulary, as the dense and MoE decoders do; pipeline parallelism is refused. Every projection is a column- or
row-parallel linear layer and the experts are `StackedExperts`, so quantized checkpoints (FP8, INT4) load through
the same methods as the dense and MoE decoders' (`framework.layers.quantization`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch import nn
from torch.nn import functional as F

from framework.layers.attention import AttentionMetadata
from framework.layers.attention.backend import paged_attention, store_kv
from framework.layers.kernels.moe_route import moe_route
from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    StackedPart,
    VocabParallelEmbedding,
)
from framework.models.gdn_layer import GatedDeltaNet, GDNGeometry
from framework.models.hf_config import UnsupportedModelError
from framework.models.interface import Model, RecurrentHybrid
from framework.models.moe import StackedExperts, moe_tensor_part
from framework.models.recurrent import RecurrentStateSpec, RecurrentStepInputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Qwen3NextConfig:
    """The Qwen3-Next / Qwen3.5 text geometry mrv2 reads from an HF `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    layer_types: tuple[str, ...]
    gdn: GDNGeometry
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Qwen3NextConfig":
        """Read an HF config dict (a multimodal one as `text_model_config` flattens it); options mrv2 cannot run
        raise `UnsupportedModelError`."""
        arch = (cfg.get("architectures") or ["Qwen3NextForCausalLM"])[0]
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (only 'silu')")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"rope_type={rope_type!r} is not supported for {arch} (only 'default')")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None:
            interval = int(cfg.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
            raise UnsupportedModelError(
                f"layer_types must name {n} layers, each 'full_attention' or 'linear_attention'; got {types}"
            )
        k_heads, v_heads = cfg.get("linear_num_key_heads", 16), cfg.get("linear_num_value_heads", 32)
        if v_heads % k_heads:
            raise UnsupportedModelError(f"linear_num_value_heads={v_heads} is not a multiple of {k_heads} key heads")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        num_experts = int(cfg.get("num_experts") or 0)
        every_layer_sparse = arch.startswith("Qwen3_5Moe")  # HF: a MoE block in every layer, top-k renormalised
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            layer_types=tuple(types),
            gdn=GDNGeometry(
                hidden_size=cfg["hidden_size"],
                num_k_heads=k_heads,
                num_v_heads=v_heads,
                head_k_dim=cfg.get("linear_key_head_dim", 128),
                head_v_dim=cfg.get("linear_value_head_dim", 128),
                conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
                eps=cfg.get("rms_norm_eps", 1e-6),
                fused_projections=arch.startswith("Qwen3Next"),
            ),
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=every_layer_sparse or bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=1 if every_layer_sparse else int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=() if every_layer_sparse else tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )

    def is_sparse(self, layer: int) -> bool:
        """HF's rule: experts exist, the layer is not MLP-only and is on the sparse-step grid."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )


class OffsetRMSNorm(nn.Module):
    """Zero-centred RMSNorm: `norm(x) * (1 + weight)` in float32, as HF's Qwen3-Next / Qwen3.5."""

    random_zeros: ClassVar[tuple[str, ...]] = ("weight",)  # random weights scale by 1 + 0

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first `cos.shape[-1]` dims of each head of x [T, heads, head_dim]."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = torch.cat([-rot[..., rd // 2 :], rot[..., : rd // 2]], dim=-1)
    return torch.cat([rot * cos[:, None] + half * sin[:, None], rest], dim=-1)


class GatedAttention(nn.Module):
    """Paged attention with q/k norms, partial rotary and a sigmoid output gate per head (this rank's heads)."""

    def __init__(self, cfg: Qwen3NextConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        tp, h, d = ctx.tp_size, cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp, cfg.num_kv_heads // tp, d
        bias = cfg.attention_bias
        # q_proj's rows are per head [query, gate]: a contiguous block of them is a rank's heads with their gates.
        self.q_proj = ColumnParallelLinear(h, 2 * cfg.num_heads * d, bias, ctx)
        self.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, bias, ctx)
        self.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, bias, ctx)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, bias, ctx)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = _rotate(self.q_norm(q), cos, sin)
        k = _rotate(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        store_kv(k, v, kv_cache, meta.kv_slot_mapping, backend=self.kernel_backend)
        out = paged_attention(q.contiguous(), kv_cache, meta, self.scale, backend=self.kernel_backend)
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """SiLU-gated MLP (the dense MLP and the shared expert): this rank's intermediate columns, down_proj reduced."""

    def __init__(self, hidden: int, intermediate: int, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, False, ctx)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, False, ctx)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Softmax top-k router + stacked experts + sigmoid-gated shared expert: [T, H] -> [T, H]. Under tensor
    parallelism every rank routes every token (replicated router) through its slice of each expert; the partial
    sums are all-reduced (the shared expert's down_proj reduces its own)."""

    def __init__(self, cfg: Qwen3NextConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.top_k, self.normalize, self.ctx = cfg.num_experts_per_tok, cfg.norm_topk_prob, ctx
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = StackedExperts(cfg, ctx)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, ctx)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.kernel_backend = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe_route(self.gate(x), self.top_k, self.normalize, x.dtype, self.kernel_backend)
        out = self.ctx.tp_all_reduce(self.experts(x, weights, ids, self.kernel_backend))
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextLayer(nn.Module):
    """Pre-norm mixer (gated attention or Gated DeltaNet) and pre-norm MLP (dense or MoE), each with a residual."""

    def __init__(self, cfg: Qwen3NextConfig, layer: int, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.layer_types[layer] == "full_attention":
            self.self_attn = GatedAttention(cfg, ctx)
        else:
            self.linear_attn = GatedDeltaNet(cfg.gdn, ctx)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            SparseMoe(cfg, ctx) if cfg.is_sparse(layer) else GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx)
        )


class Qwen3NextModel(nn.Module):
    """Embeddings, the layer stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: Qwen3NextConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.layers = nn.ModuleList(Qwen3NextLayer(cfg, i, ctx) for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_SKIPPED = ("model.visual.", "visual.", "mtp.")


class Qwen3NextForCausalLM(Model, RecurrentHybrid):
    """Qwen3-Next / Qwen3.5 causal LM: attention layers on the paged KV cache, Gated DeltaNet layers on
    per-slot recurrent state."""

    waits_per_kv_layer = True  # the forward waits for each paged layer's KV-tier loads (Model)

    model_state_name = "hybrid_recurrent"
    supports_parallel = supports_quantization = True

    def __init__(
        self, cfg: Qwen3NextConfig, ctx: ParallelContext = SINGLE, multimodal_checkpoint: bool = False
    ) -> None:
        super().__init__()
        if ctx.pp_size > 1:
            raise UnsupportedModelError(
                "Qwen3.5 / Qwen3-Next do not run under pipeline parallelism yet (their recurrent state is not "
                "split by stage); use parallel.pipeline_parallel_size=1 (tensor parallelism is supported)"
            )
        self.config, self.ctx = cfg, ctx
        self.model = Qwen3NextModel(cfg, ctx)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention_layers = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        self.linear_layers = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float32) / cfg.rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._skipped_logged = False
        if multimodal_checkpoint:  # Qwen3_5ForConditionalGeneration keeps its text model under language_model
            for name, _ in self.model.named_parameters():
                self.checkpoint_aliases[f"model.{name}"] = f"model.language_model.{name}"

    @classmethod
    def from_hf_config(cls, hf_config: dict, ctx: ParallelContext = SINGLE) -> "Qwen3NextForCausalLM":
        """Build (uninitialised) from an HF config dict, this rank's part of it under tensor parallelism."""
        return cls(Qwen3NextConfig.from_hf(hf_config), ctx, bool(hf_config.get("text_weights_prefix")))

    def init_buffers(self) -> None:
        """Recompute the rotary frequencies (after a build on the meta device, which has no values)."""
        c = self.config
        self.inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.float32) / c.rotary_dim)

    @property
    def num_kv_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def kv_heads(self) -> int:
        return self.config.num_kv_heads // self.ctx.tp_size

    @property
    def kv_head_dim(self) -> int:
        return self.config.head_dim

    def shareable_embeddings(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        return self.model.embed_tokens.weight, self.lm_head.weight

    def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
        return [self.config.gdn.per_rank(self.ctx.tp_size).state_spec(len(self.linear_layers))]

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """The vision tower and the MTP heads are not part of this model: skipped (logged once)."""
        if name.startswith(_SKIPPED):
            if not self._skipped_logged:
                logger.info("skipping the checkpoint's vision tower / MTP tensors (e.g. %s): text model only", name)
                self._skipped_logged = True
            return False
        return True

    def stacked_tensor_part(self, name: str) -> Optional[StackedPart]:
        """The experts' tensors of the target's layers (`moe_tensor_part`: per expert or fused, quantized or not,
        this rank's slice); the MTP head's are not the model's."""
        name = name.replace("model.language_model.", "model.", 1)
        return None if name.startswith("mtp.") else moe_tensor_part(self, name, self.ctx)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per attention layer
        attn_metadata: AttentionMetadata,
        gdn: RecurrentStepInputs,
    ) -> torch.Tensor:
        """[T, hidden] final hidden states."""
        x = self.model.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        kv_iter, state_iter = enumerate(kv_caches), iter(gdn.layers)
        for layer in self.model.layers:
            h = layer.input_layernorm(x)
            if hasattr(layer, "self_attn"):
                kv_layer, kv_cache = next(kv_iter)
                attn_metadata.kv_waits.layer(kv_layer)  # a KV tier's loads of this layer are in place (no-op without)
                x = x + layer.self_attn(h, cos, sin, kv_cache, attn_metadata)
            else:
                x = x + layer.linear_attn(h, next(state_iter), gdn)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)
