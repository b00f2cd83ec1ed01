"""Gemma 4's text model (`Gemma4ForCausalLM`, and the language model of `Gemma4ForConditionalGeneration`).

The model around the layers (`framework.models.gemma4_layers`): token embeddings scaled by sqrt(hidden_size);
per-layer input embeddings (a second table, scaled by sqrt(hidden_size_per_layer_input), giving every token one
vector per layer, averaged with a normed projection of its embedding); RoPE per layer kind (each kind its own
head_dim: the full layers' `proportional` RoPE turns only part of the pairs); KV caches for the layers that
compute keys and values only (the last `num_kv_shared_layers` layers read the cache of the last earlier layer of
their kind); the final norm and logit soft-cap.

Every KV tensor has token rows wide enough for the widest KV layer (`Gemma4Config.kv_row_width`) and each layer
views the first `kv_heads * head_dim` values of a row (`layer_kv_view`), so the runner allocates one shape for
all, and a KV group (cache.kv_groups) may hold full and window layers' blocks in one tensor. Parameter names are
the HF checkpoint's; a multimodal checkpoint's text weights load under the same names, its placeholder tokens
(image, video, audio) embed as padding as HF's text-only path does, and its vision and audio towers are skipped
(logged once).

Tensor parallelism splits each layer kind's heads and KV heads (so a rank's KV rows are `kv_row_width(tp)`), the
MLPs' and experts' intermediate dims and both vocabularies (the token and the per-layer tables, each scaled after
the ranks' lookups are summed); the per-layer-input projection is whole on every rank. Quantized checkpoints and
online FP8 quantize the attention and MLP projections (not the experts, refused by name). Pipeline parallelism and
LoRA are refused.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from framework.layers.attention import AttentionMetadata
from framework.layers.attention.backend import TRITON_HEAD_DIMS, order_rows_longest_first
from framework.layers.attention.kv_groups import group_metadata
from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import SINGLE, ShardSpec, StackedPart, shard_spec
from framework.models.gemma3 import TEXT_PREFIXES, ScaledEmbedding
from framework.models.gemma3_config import FULL, SLIDING
from framework.models.gemma4_config import Gemma4Config
from framework.models.gemma4_layers import Gemma4Attention, Gemma4DecoderLayer, Gemma4RMSNorm
from framework.models.gemma_parallel import check_gemma_parallel
from framework.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_SKIPPED = tuple(
    prefix + tower
    for prefix in ("model.", "")
    for tower in ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
)
_SHARED_LAYER_TENSORS = ("k_proj", "v_proj", "k_norm", "v_norm")  # HF ignores these of KV-shared layers


def layer_kv_view(kv_cache: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """[2, num_blocks, block_size, kv_heads, head_dim] view of the first `kv_heads * head_dim` values of each token
    row of `kv_cache` [2, num_blocks, block_size, H, D] (strided when the rows are wider)."""
    return kv_cache.flatten(3)[..., : kv_heads * head_dim].unflatten(3, (kv_heads, head_dim))


def _make_layer(cfg: Gemma4Config, ctx: ParallelContext, layer: int) -> nn.Module:
    return Gemma4DecoderLayer(cfg, layer, ctx)


class Gemma4ForCausalLM(LlamaForCausalLM):
    """Gemma 4 causal LM over the paged KV cache (interface of `LlamaForCausalLM`); tensor parallel and quantized
    (attention and MLPs) as the Llama family, no pipeline stages, no LoRA."""

    supports_lora = False  # KV-shared layers have no k/v projections; k_eq_v layers no v_proj
    config_cls = Gemma4Config
    make_layer = staticmethod(_make_layer)
    config: Gemma4Config

    def __init__(self, cfg: Gemma4Config, ctx: ParallelContext = SINGLE) -> None:  # type: ignore[override]
        heads = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
        check_gemma_parallel("Gemma 4", ctx, {**heads, "num_global_key_value_heads": cfg.full_kv_heads})
        super().__init__(cfg, ctx)
        model = self.model
        model.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        model.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = model.embed_tokens.weight
        if cfg.per_layer_dim:
            width, dim = cfg.num_layers * cfg.per_layer_dim, cfg.per_layer_dim
            model.embed_tokens_per_layer = ScaledEmbedding(cfg.per_layer_vocab_size, width, ctx, scale=dim**0.5)
            model.per_layer_model_projection = nn.Linear(cfg.hidden_size, width, bias=False)
            model.per_layer_projection_norm = Gemma4RMSNorm(dim, cfg.rms_norm_eps)
        self.register_buffer("full_inv_freq", torch.zeros(cfg.full_head_dim // 2), persistent=False)
        placeholders = torch.tensor(cfg.placeholder_token_ids, dtype=torch.long)
        self.register_buffer("placeholder_ids", placeholders, persistent=False)
        self.kv_index = {layer: k for k, layer in enumerate(cfg.kv_layers)}  # layer -> its KV cache in kv_caches
        self._skipped_logged = False
        self.init_buffers()

    def init_buffers(self) -> None:
        """Each kind's RoPE frequencies, the embedding scales, the value norms' unit weights, the placeholder ids
        (after a build on the meta device)."""
        cfg = self.config
        kinds = set(cfg.layer_types)
        self.inv_freq = cfg.kind_inv_freq(SLIDING if SLIDING in kinds else FULL)  # the window layers'
        self.full_inv_freq = cfg.kind_inv_freq(FULL)
        self.placeholder_ids = torch.tensor(cfg.placeholder_token_ids, dtype=torch.long)
        for module in self.modules():
            if isinstance(module, (ScaledEmbedding, Gemma4Attention)):
                module.init_buffers()

    # ---- KV geometry ---------------------------------------------------------------------------------------
    @property
    def num_kv_layers(self) -> int:
        return len(self.config.kv_layers)

    @property
    def kv_heads(self) -> int:
        """Heads of one token row of this rank's KV tensors (rows wide enough for every KV layer: `kv_row_width`)."""
        return self.config.kv_row_width(self.ctx.tp_size)[0]

    @property
    def kv_head_dim(self) -> int:
        return self.config.kv_row_width(self.ctx.tp_size)[1]

    def kv_layer_windows(self) -> list[int]:
        """The window (0: full) of each KV cache's layer, in `kv_caches` order (the runner's KV groups read it)."""
        return [self.config.layer_window(i) for i in self.config.kv_layers]

    def cuda_graph_unsupported_reason(self) -> Optional[str]:
        """On a GPU, why decode cannot be captured: a layer kind's head_dim without a Triton attention kernel
        attends through the PyTorch reference, which reads the batch's lengths on the host (the released
        configs' 256 and 512 both have kernels: None for them)."""
        dims = sorted({self.config.layer_geometry(i)[1] for i in range(self.config.num_layers)})
        missing = [d for d in dims if d not in TRITON_HEAD_DIMS]
        if missing and self.lm_head.weight.device.type == "cuda":
            return f"head_dim {missing} has no Triton attention kernel (the PyTorch reference attends those layers)"
        return None

    # ---- forward ---------------------------------------------------------------------------------------------
    def forward_with_aux(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per KV layer (`num_kv_layers`)
        attn_metadata: AttentionMetadata,
        aux_layer_ids: tuple[int, ...] = (),
        pp_hidden: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(final hidden [T, hidden], the residual stream entering each layer of `aux_layer_ids` [T, hidden])."""
        cfg = self.config
        if self.placeholder_ids.numel():  # HF's multimodal model embeds media placeholders as padding
            input_ids = torch.where(torch.isin(input_ids, self.placeholder_ids), cfg.pad_token_id, input_ids)
        x = self.model.embed_tokens(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x)
        rope = {SLIDING: self._cos_sin(positions, self.inv_freq, x.dtype)}
        rope[FULL] = self._cos_sin(positions, self.full_inv_freq, x.dtype)
        if self.longest_rows_first:  # one order for every layer (inside the forward: CUDA graphs replay it)
            attn_metadata = order_rows_longest_first(attn_metadata)
        metas = group_metadata(attn_metadata, positions, self.kv_groups)  # one per KV group (one without groups)
        kv_group = self.kv_groups.layer_group if self.kv_groups else (0,) * len(kv_caches)
        entering: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layer_ids:
                entering[i] = x
            kv = self.kv_index[cfg.kv_sources[i]]  # a KV-shared layer reads its source layer's cache
            attn_metadata.kv_waits.layer(kv)  # a KV tier's loads of that cache are in place (no-op without)
            cos, sin = rope[cfg.layer_types[i]]
            cache = layer_kv_view(kv_caches[kv], *cfg.layer_geometry(i, self.ctx.tp_size))
            pli = per_layer[:, i] if per_layer is not None else None
            x = layer(x, pli, cos, sin, cache, metas[kv_group[kv]], self.attention)
        return self.model.norm(x), tuple(entering[i] for i in aux_layer_ids)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> Optional[torch.Tensor]:
        """[T, num_layers, per_layer_dim]: (normed projection of the embedding + the per-layer table's vectors) /
        sqrt(2), as HF computes it; None without per-layer inputs."""
        cfg, model = self.config, self.model
        if not cfg.per_layer_dim:
            return None
        shape = (input_ids.shape[0], cfg.num_layers, cfg.per_layer_dim)
        table = model.embed_tokens_per_layer(input_ids).view(shape)
        projected = model.per_layer_model_projection(embeds) * cfg.hidden_size**-0.5
        return (model.per_layer_projection_norm(projected.view(shape)) + table) * 2.0**-0.5

    @staticmethod
    def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin [T, head_dim] of one layer kind (HF's order: cat([freqs, freqs]))."""
        freqs = positions.float().unsqueeze(1) * inv_freq.float().unsqueeze(0)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As `LlamaForCausalLM.compute_logits`, then `c * tanh(logits / c)` where the config has a final cap."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    # ---- loader hooks ----------------------------------------------------------------------------------------
    @staticmethod
    def _text_name(name: str) -> str:
        """The text model's name of a checkpoint tensor (a multimodal checkpoint's prefix replaced)."""
        for prefix, replacement in TEXT_PREFIXES:
            if name.startswith(prefix):
                return replacement + name[len(prefix) :]
        return name

    def stacked_tensor_part(self, name: str) -> Optional[StackedPart]:
        """A multimodal checkpoint's text tensors into the parameter of their text-model name; the experts'
        `gate_up_proj [E, 2I, H]` into `[E, 2, I, H]`; under tensor parallelism this rank's part of each."""
        param = self._text_name(name)
        if param.endswith(".experts.gate_up_proj"):
            cfg, ctx = self.config, self.ctx
            shape = (cfg.num_experts, 2, cfg.moe_intermediate_size, cfg.hidden_size)
            rows = ShardSpec(2, ctx.tp_rank, ctx.tp_size) if ctx.tp_size > 1 else None  # each half's I rows
            return StackedPart(param, (), rows, 1, source_shape=shape)
        if param == name:
            return None
        try:
            self.get_parameter(param)
        except AttributeError:
            return None  # the loader names it: a tensor without a parameter
        return StackedPart(param, (), shard_spec(self, param), 1)

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """The vision and audio towers and their projections are not part of this model: skipped (logged once), as
        are the k/v projections and norms a checkpoint may hold for KV-shared layers (HF ignores them)."""
        if name.startswith(_SKIPPED):
            if not self._skipped_logged:
                logger.info("skipping the checkpoint's vision / audio towers (e.g. %s): text model only", name)
                self._skipped_logged = True
            return False
        parts = self._text_name(name).split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 4 and parts[3] == "self_attn":
            if parts[4] in _SHARED_LAYER_TENSORS and self.config.is_kv_shared(int(parts[2])):
                return False
        return super().owns_checkpoint_tensor(name)
