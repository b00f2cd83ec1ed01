"""Decoder-only transformer for the Llama, Mistral, Qwen2 and Qwen3 families, on the paged KV cache.

Parameter names match the HF checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...), so weights load
by name. Tokens of all requests are flattened into one `[T]` batch; attention reads and writes the paged cache.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from framework.layers.attention import AttentionMetadata
from framework.layers.attention.backend import SplitCounters, order_rows_longest_first, paged_attention
from framework.layers.attention.kv_groups import group_metadata
from framework.layers.attention.qk_norm_rope import qk_norm_rope_store
from framework.layers.kernels.layer_ops import rms_norm, silu_and_mul
from framework.layers.parallel.context import ParallelContext, stage_layers
from framework.layers.parallel.linear import (
    SINGLE,
    ColumnParallelLinear,
    MissingLayer,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from framework.models.hf_config import DecoderConfig
from framework.models.interface import Model
from framework.models.lora.projection import LoraGroup
from framework.models.merge_rows import merge_rows
from framework.models.small_batch import small_batch_layer, small_batch_logits
from framework.params.kv_groups import KVGroupLayout

# (query, kv_cache, meta, scale, **keywords) -> output; keywords as `backend.paged_attention` takes (window, pdl, ...).
AttentionFn = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, backend=self.kernel_backend)[0].view(x.shape)

    def add_and_norm(
        self, x: torch.Tensor, residual: Optional[torch.Tensor], pdl: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass; `residual` None (the first layer) means x alone.
        `pdl`: the kernel with programmatic dependent launch (framework/layers/kernels/pdl.py)."""
        if residual is None:
            flat = x.reshape(-1, x.shape[-1])
            return rms_norm(flat, self.weight, self.eps, pdl=pdl, backend=self.kernel_backend)[0].view(x.shape), x
        out, summed = rms_norm(x, self.weight, self.eps, residual, pdl=pdl, backend=self.kernel_backend)
        assert summed is not None
        return out, summed


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
        self.qkv_weight: Optional[torch.Tensor] = None  # set by fuse_projections (after the weights are loaded)
        self.qkv_bias: Optional[torch.Tensor] = None
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)
        self.lora_qkv: Optional[LoraGroup] = None  # adapter slots (models/lora/projection.py attach_lora)
        self.lora_o: Optional[LoraGroup] = None
        self.window = 0  # keys a query sees, its own included (0: full); set per layer by DecoderModel

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        attention: AttentionFn,
    ) -> torch.Tensor:
        return self.project_out(self.rope_store_attend(self.project_qkv(x), cos, sin, kv_cache, meta, attention))

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, (H + 2 Hkv) * head_dim]
        """This rank's q, k, v: one GEMM once merged (fuse_projections), plus each token's LoRA update if any."""
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return qkv if self.lora_qkv is None else self.lora_qkv.add(x, qkv)

    def project_out(self, attn_out: torch.Tensor) -> torch.Tensor:  # [T, H * head_dim] -> [T, hidden]
        """o_proj, plus each token's LoRA update when adapters are attached."""
        out = self.o_proj(attn_out)
        return out if self.lora_o is None else self.lora_o.add(attn_out, out)

    def rope_store_attend(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) * head_dim]: this rank's q, k, v heads
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionFn,
        pdl: bool = False,  # the kernels with programmatic dependent launch (small-batch path, layers/kernels/pdl.py)
    ) -> torch.Tensor:  # [T, H * head_dim]: the input of o_proj
        """Per-head q/k norm (Qwen3), RoPE and the KV store in one kernel, then attention over the cache."""
        q = self.rope_store(qkv, cos, sin, kv_cache, meta.kv_slot_mapping, pdl)
        out = attention(q, kv_cache, meta, self.scale, window=self.window, **({"pdl": True} if pdl else {}))
        return out.reshape(qkv.shape[0], self.num_heads * self.head_dim)

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_slot_mapping: torch.Tensor,
        pdl: bool = False,
    ) -> torch.Tensor:  # [T, H, head_dim]
        """q normed + roped; k normed + roped and v stored at `kv_slot_mapping` (negative: skipped)."""
        return qk_norm_rope_store(
            qkv,
            cos,
            sin,
            self.q_norm.weight if self.qk_norm else None,
            self.k_norm.weight if self.qk_norm else None,
            self.q_norm.eps if self.qk_norm else 0.0,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            kv_cache,
            kv_slot_mapping,
            pdl,
            self.kernel_backend,
        )

    def fuse_projections(self) -> None:
        """Serve q/k/v from one [q + k + v, hidden] weight (one GEMM); the three weights become views of it."""
        self.qkv_weight, self.qkv_bias = merge_rows([self.q_proj, self.k_proj, self.v_proj])


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ctx)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ctx)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, ctx)
        self.gate_up_weight: Optional[torch.Tensor] = None  # set by fuse_projections
        self.gate_up_bias: Optional[torch.Tensor] = None
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)
        self.lora_gate_up: Optional[LoraGroup] = None  # adapter slots (models/lora/projection.py attach_lora)
        self.lora_down: Optional[LoraGroup] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None and self.lora_gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.gate_up_weight is not None:
            gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        else:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        if self.lora_gate_up is not None:
            gate_up = self.lora_gate_up.add(x, gate_up)
        act = silu_and_mul(gate_up, self.kernel_backend)
        out = self.down_proj(act)
        return out if self.lora_down is None else self.lora_down.add(act, out)

    def fuse_projections(self) -> None:
        """Serve gate and up from one [2 * intermediate, hidden] weight; the two become views of it."""
        self.gate_up_weight, self.gate_up_bias = merge_rows([self.gate_proj, self.up_proj])


def fuse_projections(model: nn.Module) -> None:
    """Merge every `Attention`'s q/k/v and every `MLP`'s gate/up projections of `model` (inference only: call
    once the weights are loaded; training keeps the separate projections)."""
    for module in model.modules():
        if isinstance(module, (Attention, MLP)):
            module.fuse_projections()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ctx)
        self.small_batch_max_tokens = 0  # forwards of <= this many tokens take the GEMVs (enable_small_batch)
        self.programmatic_launch = False  # the small-batch path's kernels launch with PDL (enable_small_batch)
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)

    def forward(self, x, residual, cos, sin, kv_cache, meta, attention):  # type: ignore[no-untyped-def]
        """(this layer's MLP output, the residual stream before it is added): the next norm adds the two, so
        every residual add is fused into a norm. `residual` None (first layer): `x` is the stream.

        A batch of at most `small_batch_max_tokens` tokens runs the fused GEMV path (same semantics); the choice
        reads only the shape, so a CUDA graph captured at a padded batch size freezes one path."""
        if 0 < x.shape[0] <= self.small_batch_max_tokens:  # (0 tokens: the default path, enabled or not)
            return small_batch_layer(self, x, residual, cos, sin, kv_cache, meta, attention)
        q, residual = self.before_attention(x, residual, cos, sin, kv_cache, meta.kv_slot_mapping)
        attn = self.self_attn
        return self.after_attention(attention(q, kv_cache, meta, attn.scale, window=attn.window), residual)

    def before_attention(self, x, residual, cos, sin, kv_cache, kv_slot_mapping):  # type: ignore[no-untyped-def]
        """(q [T, H, head_dim], the residual stream): the norm, the q/k/v projection, q/k norm + RoPE and the KV
        store of this layer (`forward`'s part before attention; runner/graphs/prefill_graphs.py captures it)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        return self.self_attn.rope_store(self.self_attn.project_qkv(h), cos, sin, kv_cache, kv_slot_mapping), residual

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream) from `attn_out` [T, H, head_dim]: o_proj, the residual add + norm and the
        MLP (`forward`'s part after attention)."""
        h = self.self_attn.project_out(attn_out.reshape(attn_out.shape[0], -1))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


# (config, parallel context, layer index) -> a layer with DecoderLayer's forward (models/moe.py builds MoE ones).
LayerFactory = Callable[[DecoderConfig, ParallelContext, int], nn.Module]


class DecoderModel(nn.Module):
    """Embedding, layers and final norm; a pipeline stage builds only its layers (and the embedding on the first
    stage, the norm on the last), the others are `MissingLayer`s so that names keep their indices. `make_layer`
    builds layer i (default: a dense `DecoderLayer`)."""

    def __init__(
        self, cfg: DecoderConfig, ctx: ParallelContext = SINGLE, make_layer: Optional[LayerFactory] = None
    ) -> None:
        super().__init__()
        self.stage_layers = stage_layers(cfg.num_layers, ctx.pp_rank, ctx.pp_size)
        if ctx.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        make = make_layer or (lambda c, x, _i: DecoderLayer(c, x))
        self.layers = nn.ModuleList(
            make(cfg, ctx, i) if i in self.stage_layers else MissingLayer() for i in range(cfg.num_layers)
        )
        for i in self.stage_layers:  # sliding-window layers (Mistral, Qwen2's upper layers, gpt-oss's)
            if isinstance(getattr(self.layers[i], "self_attn", None), Attention):
                self.layers[i].self_attn.window = cfg.layer_window(i)
        if ctx.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(Model):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over the paged KV cache.

    `forward` returns hidden states `[T, hidden]`; `compute_logits` turns the rows that are sampled into
    logits `[L, vocab]` in the model dtype (the sampler widens them where it needs float32). Under parallelism
    (`ctx`) this rank holds its heads, its MLP columns and its vocabulary rows of its pipeline stage's layers only.
    """

    supports_parallel = supports_quantization = waits_per_kv_layer = True  # waits: each layer's KV-tier loads
    config_cls: type[DecoderConfig] = DecoderConfig  # reads config.json (a subclass adds its family's fields)
    make_layer: Optional[LayerFactory] = None  # layer builder of a subclass (None: dense DecoderLayer)

    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config, self.ctx = cfg, ctx
        self.model = DecoderModel(cfg, ctx, type(self).make_layer)
        # A stage without the embedding loads a tied LM head from the embedding's checkpoint tensor.
        if ctx.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx)
            if cfg.tie_word_embeddings and ctx.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight
            elif cfg.tie_word_embeddings:
                self.checkpoint_aliases["lm_head.weight"] = "model.embed_tokens.weight"
        self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)
        self.split_counters = SplitCounters()  # reused by every layer, step and graph replay of this model
        self.small_batch_max_tokens = 0  # logits of <= this many rows take the GEMV LM head (enable_small_batch)
        self.programmatic_launch = False  # that LM head and the final norm before it launch with PDL (same)
        self.longest_rows_first = True  # large decode batches: attention starts with the longest rows (kernels.*)
        self.kv_groups: Optional[KVGroupLayout] = None  # set by the runner when its block tables are per KV group
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)

    def attention(  # query [T, num_heads, head_dim]; kwargs: window, sinks, pdl, out (backend.paged_attention)
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, **kwargs: Any
    ) -> torch.Tensor:
        """Paged attention with this model's split counters and kernel backend (every layer calls this)."""
        return paged_attention(
            query, kv_cache, meta, scale, split_counters=self.split_counters, backend=self.kernel_backend, **kwargs
        )

    def init_buffers(self) -> None:
        """Recompute the buffers from the config (after a build on the meta device, which has no values)."""
        self.inv_freq = self.config.rope_inv_freq()

    @classmethod
    def from_hf_config(cls, hf_config: dict, ctx: ParallelContext = SINGLE) -> "LlamaForCausalLM":
        """Build (uninitialised) from an HF config dict, this rank's part of it under parallelism."""
        return cls(cls.config_cls.from_hf(hf_config), ctx)

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """False for tensors of other pipeline stages (the loader skips them without reading)."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.model.stage_layers
        if name.startswith("model.embed_tokens."):
            return self.ctx.is_first_stage or (self.ctx.is_last_stage and self.config.tie_word_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.ctx.is_last_stage
        return True

    @property
    def num_kv_layers(self) -> int:
        return len(self.model.stage_layers)

    @property
    def kv_heads(self) -> int:
        return self.config.num_kv_heads // self.ctx.tp_size

    @property
    def kv_head_dim(self) -> int:
        return self.config.head_dim

    def shareable_embeddings(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        embed = self.model.embed_tokens.weight if self.ctx.is_first_stage else None
        return embed, self.lm_head.weight if self.ctx.is_last_stage else None

    def check_max_model_len(self, max_model_len: int) -> None:
        self.config.check_max_model_len(max_model_len)

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

        The loop carries each layer's output and the residual stream apart (the next norm adds them), so an aux
        state costs one add; a CUDA graph captured over this method returns them as outputs.
        Layer ids are global; under pipeline parallelism only this stage's layers can be asked for.
        """
        x = self.model.embed_tokens(input_ids) if pp_hidden is None else pp_hidden
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        if self.longest_rows_first:  # one order for every layer (inside the forward: CUDA graphs replay it)
            attn_metadata = order_rows_longest_first(attn_metadata)
        metas = group_metadata(attn_metadata, positions, self.kv_groups)  # one per KV group (one without groups)
        layer_group = self.kv_groups.layer_group if self.kv_groups else (0,) * len(self.model.layers)
        entering: dict[int, torch.Tensor] = {}
        residual: Optional[torch.Tensor] = None
        for kv_layer, (i, kv_cache) in enumerate(zip(self.model.stage_layers, kv_caches)):
            if i in aux_layer_ids:
                entering[i] = x if residual is None else x + residual
            attn_metadata.kv_waits.layer(kv_layer)  # a KV tier's loads of this layer are in place (no-op without)
            x, residual = self.model.layers[i](x, residual, cos, sin, kv_cache, metas[layer_group[i]], self.attention)
        if self.ctx.is_last_stage:
            pdl = self.programmatic_launch and 0 < x.shape[0] <= self.small_batch_max_tokens
            x = self.model.norm.add_and_norm(x, residual, pdl)[0]
        elif residual is not None:
            x = x + residual  # the next stage starts from the stream
        return x, tuple(entering[i] for i in aux_layer_ids)

    def rope_cos_sin(
        self,
        positions: torch.Tensor,  # [T] int64
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, head_dim] each
        """RoPE's cos and sin of each position, in `dtype` (HF's order: cat([freqs, freqs]))."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[L, hidden] -> [L, vocab] in the LM head's output dtype: the model dtype (float32 from the small-batch
        GEMV of a single rank, which writes it so at no cost). No float32 copy here: at 256 x 151,936 it cost
        0.12 ms of a 7 ms H200 decode step, and the fused sampler reads bf16 itself; the sampler's stages that
        need float32 cast there (`samplers.sampler`)."""
        if 0 < hidden.shape[0] <= self.small_batch_max_tokens:
            return small_batch_logits(self.lm_head, hidden, self.programmatic_launch, self.kernel_backend)
        return self.lm_head(hidden)
