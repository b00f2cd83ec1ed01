"""Mixture-of-Experts decoders: Qwen3-MoE, Qwen2-MoE (with its shared expert) and Mixtral.

The attention, norms, embedding and LM head are the dense decoder's (`framework.models.llama`); each sparse
layer's MLP is a `SparseMoeBlock`: a router (softmax over the experts, top-k, renormalised when the config says
`norm_topk_prob`: `framework.layers.kernels.moe_route`), and the experts in one fused kernel
(`framework.layers.kernels.fused_moe`).

Expert weights are stacked at load time into one tensor per projection, `mlp.experts.gate_up_proj [E, 2, I, H]`
and `mlp.experts.down_proj [E, H, I]`, from the checkpoint's per-expert tensors (`experts.{e}.gate_proj.weight`,
or Mixtral's `block_sparse_moe.experts.{e}.w1` / `w3` / `w2`) or from HF v5's fused ones: `stacked_tensor_part`
tells the loader where each one goes. Tensor parallelism splits every expert's intermediate dimension I (both
halves of gate_up alike; quantized experts' scales and packed words as their method's `checkpoint_split` says); the
router is replicated, every rank routes identically, and the experts' partial sums
are all-reduced once per layer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Protocol

import torch
from torch import nn

from framework.layers.kernels.fused_moe import fused_moe
from framework.layers.kernels.moe_route import moe_route
from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import SINGLE, ShardSpec, StackedPart, _divide
from framework.layers.quantization.moe import stacked_name
from framework.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from framework.models.moe_config import MoeConfig


class ExpertGeometry(Protocol):
    """What stacked experts read of a config (`MoeConfig`, Qwen3-Next's)."""

    @property
    def num_experts(self) -> int: ...

    @property
    def moe_intermediate_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...


class StackedExperts(nn.Module):
    """All experts of one layer: `gate_up_proj [E, 2, I / tp, H]` (gate, up) and `down_proj [E, H, I / tp]`."""

    def __init__(self, cfg: ExpertGeometry, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        i = _divide(cfg.moe_intermediate_size, ctx.tp_size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2, i, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, i))
        self.shard_dims = {"gate_up_proj": 2, "down_proj": 2}  # the intermediate dimension (random weights)
        self.ctx = ctx
        self.stacked_experts = True  # quantized checkpoints: framework.layers.quantization.moe
        self.expert_dims = (cfg.num_experts, i, cfg.hidden_size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, backend: str) -> torch.Tensor:
        """[T, H] -> [T, H]: the experts' MLP of `x` routed to `ids` [T, top-k] with `weights` (fused kernel)."""
        method = getattr(self, "quant_method", None)
        if method is not None:
            return method.apply_experts(self, x, weights, ids, backend)  # type: ignore[no-any-return]
        return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, backend)


class SparseMoeBlock(nn.Module):
    """Router + stacked experts (+ Qwen2-MoE's sigmoid-gated shared expert): [T, H] -> [T, H]."""

    def __init__(self, cfg: MoeConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.round_weights = cfg.round_router_weights
        self.ctx = ctx
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router, whole on every rank
        self.experts = StackedExperts(cfg, ctx)
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)
        if cfg.shared_expert_intermediate_size:
            shared = dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size, mlp_bias=False)
            self.shared_expert: Optional[MLP] = MLP(shared, ctx)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        # Qwen applies the routing weights in the model dtype, Mixtral in float32.
        weight_dtype = x.dtype if self.round_weights else torch.float32
        weights, ids = moe_route(self.gate(x), self.top_k, self.normalize, weight_dtype, self.kernel_backend)
        out = self.experts(x, weights, ids, self.kernel_backend)
        if self.ctx.tp_size > 1:
            out = self.ctx.tp_all_reduce(out)  # each rank summed its slice of every expert's intermediate dim
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeDecoderLayer(nn.Module):
    """A decoder layer (the dense one's forward) whose `mlp` is a `SparseMoeBlock`, or a dense `MLP` on layers the
    config keeps dense."""

    def __init__(self, cfg: MoeConfig, ctx: ParallelContext, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoeBlock(cfg, ctx) if cfg.is_sparse_layer(layer) else MLP(cfg, ctx)

    def forward(self, x, residual, cos, sin, kv_cache, meta, attention):  # type: ignore[no-untyped-def]
        """(this layer's MLP output, the residual stream before it is added), as `DecoderLayer.forward`."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, attention)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


def _make_moe_layer(cfg: MoeConfig, ctx: ParallelContext, layer: int) -> nn.Module:
    return MoeDecoderLayer(cfg, ctx, layer)


# Checkpoint layouts (module `mlp`, or Mixtral's `block_sparse_moe` on the Hub; `model.layers` or an MTP head's
# `mtp.layers`):
#   per expert      model.layers.{L}.{mlp|block_sparse_moe}.experts.{e}.{gate_proj|up_proj|down_proj|w1|w3|w2}.weight
#   fused (HF v5)   model.layers.{L}.mlp.experts.gate_up_proj [E, 2I, H] (gate rows first), ...experts.down_proj
#   router          model.layers.{L}.{mlp|block_sparse_moe}.gate.weight
_EXPERT_TENSOR = re.compile(
    r"^((?:model|mtp)\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\."
    r"(weight|weight_scale_inv|weight_scale|input_scale|weight_packed|weight_shape|qweight|qzeros|scales|g_idx)$"
)
_FUSED_GATE_UP = re.compile(r"^((?:model|mtp)\.layers\.\d+)\.mlp\.experts\.gate_up_proj$")
_MIXTRAL_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
# projection -> (stacked parameter, index after the expert's, dim of the checkpoint tensor that tp splits)
_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", (0,), 0),
    "w1": ("gate_up_proj", (0,), 0),
    "up_proj": ("gate_up_proj", (1,), 0),
    "w3": ("gate_up_proj", (1,), 0),
    "down_proj": ("down_proj", (), 1),
    "w2": ("down_proj", (), 1),
}


def _stacked(model: nn.Module, name: str) -> Optional[nn.Parameter]:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None  # a dense layer, or another pipeline stage's: the loader decides


def moe_tensor_part(model: nn.Module, name: str, ctx: ParallelContext) -> Optional[StackedPart]:
    """Where checkpoint tensor `name` goes in `model`'s stacked experts when not simply into the parameter of its
    name (else None).

    Per-expert tensors: `experts.{e}.gate_proj` / `w1` fill `gate_up_proj[e, 0]`, `up_proj` / `w3`
    `gate_up_proj[e, 1]`, `down_proj` / `w2` `down_proj[e]` (a quantized one's scales and packed words the stacked
    parameters of their names, `layers/quantization/moe.py`); under tensor parallelism (`ctx`) this rank reads its
    rows (gate/up) or columns (down) of the expert's intermediate dimension. A fused `[E, 2I, H]` gate_up (HF v5's
    in-memory layout, the published Qwen3.5-MoE checkpoints) is read whole and viewed as `[E, 2, I, H]`;
    Mixtral's `block_sparse_moe.gate` is the router `mlp.gate`.
    """

    def shard(dim: int) -> Optional[ShardSpec]:
        return ShardSpec(dim, ctx.tp_rank, ctx.tp_size) if ctx.tp_size > 1 else None

    if (match := _MIXTRAL_ROUTER.match(name)) is not None:
        router = f"{match.group(1)}.mlp.gate.weight"
        return StackedPart(router, (), None, 1) if _stacked(model, router) is not None else None
    if (match := _FUSED_GATE_UP.match(name)) is not None:
        stacked = _stacked(model, f"{match.group(1)}.mlp.experts.gate_up_proj")
        if stacked is None:
            return None
        e, _, i, h = stacked.shape
        full = (e, 2, i * ctx.tp_size, h)
        return StackedPart(f"{match.group(1)}.mlp.experts.gate_up_proj", (), shard(2), 1, full)
    match = _EXPERT_TENSOR.match(name)
    if match is None or match.group(3) not in _PROJECTIONS:
        return None
    expert = int(match.group(2))
    param, index, dim = _PROJECTIONS[match.group(3)]
    leaf = stacked_name(param, match.group(4))
    param_name = f"{match.group(1)}.mlp.experts.{leaf}"
    stacked = _stacked(model, param_name)
    if stacked is None or expert >= stacked.shape[0]:
        return None
    parts = stacked.shape[0] * (2 if param == "gate_up_proj" else 1)
    # A quantized tensor's split dim (scales, packed words) as its method says; None: read whole.
    split = getattr(model.get_submodule(f"{match.group(1)}.mlp.experts"), "checkpoint_split", {})
    split_dim = split[leaf] if leaf in split else dim
    return StackedPart(param_name, (expert, *index), None if split_dim is None else shard(split_dim), parts)


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE / Qwen2-MoE / Mixtral causal LM over the paged KV cache (interface of `LlamaForCausalLM`)."""

    config_cls = MoeConfig
    supports_quantization = True
    make_layer = staticmethod(_make_moe_layer)

    def stacked_tensor_part(self, name: str) -> Optional[StackedPart]:
        """Where checkpoint tensor `name` goes when not simply into the parameter of its name (`moe_tensor_part`)."""
        return moe_tensor_part(self, name, self.ctx)
