"""Gemma 3's text model (`Gemma3ForCausalLM`, and the language model of `Gemma3ForConditionalGeneration`).

Beyond the dense decoder: token embeddings scaled by sqrt(hidden_size), RMSNorms scaling by `1 + weight`, q/k
norms, a norm after attention and around the MLP (sandwich norms), a GELU-tanh MLP, attention scaled by
`query_pre_attn_scalar ** -0.5`, per-layer-kind attention (a `sliding_window` on the `sliding_attention` layers,
through the paged kernels' window) with its own RoPE base (`rope_local_base_freq`; the full layers take
`rope_theta` and the rope scaling), and an optional final logit soft-cap. Parameter names are the HF checkpoint's;
a multimodal checkpoint's text weights (`language_model.model.*` or `model.language_model.*`) load under the same
names and its vision tower and projector are skipped (logged once).

Tensor parallelism splits the heads (q/k/v column-parallel, o_proj row-parallel), the MLP's intermediate dim and the
vocabulary (the embedding scale multiplies the ranks' summed lookups), window and full layers alike; quantized
checkpoints and online FP8 quantize the attention and MLP projections as the Llama family's. Pipeline parallelism
is refused (`gemma_parallel`).
"""

from __future__ import annotations

import logging
from typing import ClassVar, Optional

import torch
from torch import nn
from torch.nn import functional as F

from framework.layers.attention.qk_norm_rope import qk_norm_rope_store
from framework.layers.kernels.layer_ops import rms_norm
from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import SINGLE, StackedPart, VocabParallelEmbedding, shard_spec
from framework.models.gemma3_config import Gemma3Config
from framework.models.gemma_parallel import check_gemma_parallel
from framework.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm

logger = logging.getLogger(__name__)

# Where a Gemma3ForConditionalGeneration checkpoint keeps its text model (older and newer transformers layouts).
TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."), ("language_model.", ""))
_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
FULL_ROPE, LOCAL_ROPE = 0, 1  # rows of `rope_cos_sin`'s stacked cos / sin


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by `1 + weight` (Gemma's checkpoints store the offset from one), in float32 and rounded
    once, as HF's Gemma norm (a 16-bit `1 + weight` would lose the weight's low bits). `scale_mode`: the
    `rms_norm` keyword that says how the weight scales (a subclass may pick another)."""

    scale_mode: ClassVar[dict[str, bool]] = {"unit_offset": True}
    random_zeros: ClassVar[tuple[str, ...]] = ("weight",)  # zero-centred: random weights scale by 1 + 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        flat = x.reshape(-1, x.shape[-1])
        return rms_norm(flat, self.weight, self.eps, backend=self.kernel_backend, **self.scale_mode)[0].view(x.shape)

    def add_and_norm(
        self, x: torch.Tensor, residual: Optional[torch.Tensor], pdl: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), as `RMSNorm.add_and_norm` with this norm's scale."""
        if residual is None:
            return self(x), x
        out, summed = rms_norm(
            x, self.weight, self.eps, residual, pdl=pdl, backend=self.kernel_backend, **self.scale_mode
        )
        assert summed is not None
        return out, summed


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embedding times `scale` (default sqrt(hidden_size)); the factor is a buffer, so it is cast (rounded) to
    the model dtype with the weights, as HF does."""

    def __init__(
        self, vocab_size: int, hidden_size: int, ctx: ParallelContext = SINGLE, scale: Optional[float] = None
    ) -> None:
        super().__init__(vocab_size, hidden_size, ctx)
        self.scale = hidden_size**0.5 if scale is None else scale
        self.register_buffer("embed_scale", torch.tensor(self.scale), persistent=False)

    def init_buffers(self) -> None:
        """The factor again (after a build on the meta device)."""
        self.embed_scale = torch.tensor(self.scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return super().forward(input_ids) * self.embed_scale


class GemmaMLP(MLP):
    """gate/up/down as `MLP`, with GELU (tanh approximation) in place of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.gate_up_weight is not None:
            gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        else:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        if self.lora_gate_up is not None:
            gate_up = self.lora_gate_up.add(x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
        out = self.down_proj(act)
        return out if self.lora_down is None else self.lora_down.add(act, out)


class Gemma3DecoderLayer(nn.Module):
    """Norm, attention (q/k norms, this layer's window and RoPE), norm, add; norm, GELU-tanh MLP, norm, add."""

    def __init__(self, cfg: Gemma3Config, ctx: ParallelContext, layer: int) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = Attention(cfg, ctx)
        self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, eps)
        self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, eps)
        self.self_attn.scale = cfg.query_pre_attn_scalar**-0.5
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = GemmaMLP(cfg, ctx)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.window = cfg.layer_window(layer)
        self.rope_row = LOCAL_ROPE if self.window else FULL_ROPE

    def forward(self, x, residual, cos, sin, kv_cache, meta, attention):  # type: ignore[no-untyped-def]
        """(this layer's MLP output, the residual stream before it is added), as `DecoderLayer.forward`; `cos` and
        `sin` are [2, T, head_dim] (full layers' RoPE, window layers')."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn
        q = qk_norm_rope_store(
            attn.project_qkv(h),
            cos[self.rope_row],
            sin[self.rope_row],
            attn.q_norm.weight,
            attn.k_norm.weight,
            attn.q_norm.eps,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            kv_cache,
            meta.kv_slot_mapping,
            backend=attn.kernel_backend,
            unit_offset=True,
        )
        o = attention(q, kv_cache, meta, attn.scale, window=self.window)
        h = self.post_attention_layernorm(attn.project_out(o.reshape(o.shape[0], -1)))
        h, residual = self.pre_feedforward_layernorm.add_and_norm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


def _make_layer(cfg: Gemma3Config, ctx: ParallelContext, layer: int) -> nn.Module:
    return Gemma3DecoderLayer(cfg, ctx, layer)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 causal LM over the paged KV cache (interface of `LlamaForCausalLM`); tensor parallel and quantized
    as the Llama family, no pipeline stages."""

    config_cls = Gemma3Config
    make_layer = staticmethod(_make_layer)

    def __init__(self, cfg: Gemma3Config, ctx: ParallelContext = SINGLE) -> None:  # type: ignore[override]
        check_gemma_parallel(
            "Gemma 3", ctx, {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
        )
        super().__init__(cfg, ctx)
        self.model.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.model.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("local_inv_freq", cfg.local_rope_inv_freq(), persistent=False)
        self._skipped_logged = False

    def init_buffers(self) -> None:
        """Both kinds' RoPE frequencies and the embedding scale (after a build on the meta device)."""
        super().init_buffers()
        self.local_inv_freq = self.config.local_rope_inv_freq()  # type: ignore[attr-defined]
        self.model.embed_tokens.init_buffers()

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [2, T, head_dim]: row `FULL_ROPE` for full layers, `LOCAL_ROPE` for window layers."""
        inv = torch.stack([self.inv_freq, self.local_inv_freq])  # [2, D/2]
        freqs = positions.float()[None, :, None] * inv[:, None, :]  # [2, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As `LlamaForCausalLM.compute_logits`, then `c * tanh(logits / c)` where the config has a final cap."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap  # type: ignore[attr-defined]
        return torch.tanh(logits / cap) * cap if cap else logits

    def stacked_tensor_part(self, name: str) -> Optional[StackedPart]:
        """A multimodal checkpoint's text tensors into the parameter of their text-model name (this rank's part
        of it under tensor parallelism)."""
        for prefix, replacement in TEXT_PREFIXES:
            if name.startswith(prefix):
                param = replacement + name[len(prefix) :]
                try:
                    self.get_parameter(param)
                except AttributeError:
                    return None  # the loader names it: a tensor without a parameter
                return StackedPart(param, (), shard_spec(self, param), 1)
        return None

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """A multimodal checkpoint's vision tower and projector are not part of this model: skipped (logged once)."""
        if name.startswith(_SKIPPED):
            if not self._skipped_logged:
                logger.info("skipping the checkpoint's vision tower and projector (e.g. %s): text model only", name)
                self._skipped_logged = True
            return False
        return super().owns_checkpoint_tensor(name)
