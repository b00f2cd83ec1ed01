"""gpt-oss (`GptOssForCausalLM`): the dense decoder's attention with learned sinks, alternating sliding-window and
full layers, and a top-k MoE whose experts carry biases and a clamped SwiGLU.

Parameter names are the HF checkpoint's (`mlp.router`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, their
`_bias`, `self_attn.sinks [H]`), so weights load by name. The experts run in the fused MoE Triton kernels
(`framework/layers/kernels/fused_moe.py`) with their biases and the clamped SwiGLU as the kernels' epilogue
(`moe_epilogue.py`), so their parameters hold the kernels' layout: the checkpoint's `gate_up_proj [E, H, 2I]` (gate
and up interleaved column by column) is de-interleaved at load into `[E, 2, I, H]`, its bias `[E, 2I]` into
`[E, 2, I]`, and `down_proj [E, I, H]` transposed into `[E, H, I]` (`stacked_tensor_part`). MXFP4 checkpoints
(`quant_method: mxfp4`, the released weights) keep their FP4 bytes and E8M0 scales (`Mxfp4MoeMethod`), their gate/up
rows de-interleaved the same way; the kernels dequantize them in registers.

Tensor parallelism splits the attention heads (each rank keeps the sinks of its heads; o_proj adds its bias once,
after the all-reduce) and every expert's intermediate dimension I, as for Qwen3-MoE (`framework.models.moe`): the
router is replicated, gate/up and their bias keep this rank's I / tp rows, down its I / tp input columns, and the
experts' partial outputs are all-reduced once per layer. The down bias is added by tensor rank 0 only, so the sum
over ranks holds it once. MXFP4 experts split on whole blocks of 32 inputs (`Mxfp4MoeMethod`).
"""

from __future__ import annotations

import re
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from framework.layers.kernels.fused_moe import fused_moe
from framework.layers.kernels.moe_epilogue import CLAMPED_SWIGLU, MoeEpilogue
from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import SINGLE, ShardSpec, StackedPart, _divide
from framework.models.gpt_oss_config import GptOssConfig
from framework.models.llama import Attention, LlamaForCausalLM, RMSNorm


def deinterleave_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's `gate_up_proj [E, H, 2I]` (gate = [..., ::2], up = [..., 1::2]) -> `[E, 2, I, H]` (a view)."""
    e, h, two_i = gate_up.shape
    return gate_up.view(e, h, two_i // 2, 2).permute(0, 3, 2, 1)


class GptOssAttention(Attention):
    """The dense decoder's attention with a learned sink logit per head: `sinks [H / tp]`, this rank's heads."""

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__(cfg, ctx)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.shard_dims = {"sinks": 0}  # split with the heads (q_proj's rows)
        self.ctx = ctx


class GptOssExperts(nn.Module):
    """All experts of one layer in the fused MoE kernels' layout (module docstring), this rank's I / tp of each:
    `gate_up_proj [E, 2, I, H]`, `gate_up_proj_bias [E, 2, I]`, `down_proj [E, H, I]`, `down_proj_bias [E, H]`."""

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        e, h = cfg.num_experts, cfg.hidden_size
        i = _divide(cfg.intermediate_size, ctx.tp_size, "intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2, i, h))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2, i))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))  # whole on every rank, added by rank 0 (epilogue)
        # The intermediate dimension (random weights; the checkpoint's expert tensors: stacked_tensor_part).
        self.shard_dims = {"gate_up_proj": 2, "gate_up_proj_bias": 2, "down_proj": 2}
        self.ctx = ctx
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.stacked_experts = True  # quantized checkpoints: framework.layers.quantization.moe
        self.expert_dims = (e, i, h)
        self.intermediate_key = "intermediate_size"  # the config key named by quantized experts' refusals
        self.quant_formats = ("mxfp4",)

    def epilogue(self) -> MoeEpilogue:
        """The biases and the clamped SwiGLU, as the kernels take them. Each tensor rank's output is a partial sum
        over its slice of I, all-reduced by the caller: only rank 0 adds the down bias, so the sum has it once."""
        down_bias = self.down_proj_bias if self.ctx.tp_rank == 0 else None
        return MoeEpilogue(CLAMPED_SWIGLU, self.alpha, self.limit, self.gate_up_proj_bias, down_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] routing weights
        ids: torch.Tensor,  # [T, k] int64 expert ids
        backend: str,  # kernels.backend
    ) -> torch.Tensor:  # [T, H]
        """The routed experts' MLP: the fused kernels on CUDA (graph-safe), their PyTorch reference otherwise."""
        method = getattr(self, "quant_method", None)
        if method is not None:
            return method.apply_experts(self, x, weights, ids, backend, self.epilogue())  # type: ignore[no-any-return]
        return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, backend, self.epilogue())


class GptOssMoe(nn.Module):
    """Router (a biased linear, whole on every rank; softmax over the top-k logits) and the experts: [T, H] ->
    [T, H]."""

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg, ctx)
        self.ctx = ctx
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # every rank routes every token alike
        out = self.experts(x, torch.softmax(top, dim=-1), ids, self.kernel_backend)
        return self.ctx.tp_all_reduce(out) if self.ctx.tp_size > 1 else out


class GptOssDecoderLayer(nn.Module):
    """Norm, attention with sinks over this layer's window (0: full), norm, MoE."""

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoe(cfg, ctx)
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
        h = attn.o_proj(o.reshape(o.shape[0], -1))  # row-parallel: the ranks' heads summed, then the bias once
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


def _make_layer(cfg: GptOssConfig, ctx: ParallelContext, layer: int) -> nn.Module:
    return GptOssDecoderLayer(cfg, ctx, layer)


# Checkpoint expert tensors whose layout differs from the kernels' (`stacked_tensor_part`).
_EXPERT_TENSOR = re.compile(
    r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|gate_up_proj_blocks|"
    r"gate_up_proj_scales|down_proj_blocks)$"
)


def _rearrangement(tensor: str, e: int, i: int, h: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Checkpoint layout -> kernel layout of one expert tensor (E experts, intermediate I, hidden H)."""
    if tensor == "gate_up_proj":  # [E, H, 2I] interleaved -> [E, 2, I, H]
        return deinterleave_gate_up
    if tensor == "gate_up_proj_bias":  # [E, 2I] interleaved -> [E, 2, I]
        return lambda t: t.view(e, i, 2).transpose(1, 2)
    if tensor == "down_proj":  # [E, I, H] -> [E, H, I]
        return lambda t: t.transpose(1, 2)
    if tensor == "down_proj_blocks":  # [E, H, I / 32, 16] -> [E, H, I / 2]
        return lambda t: t.reshape(e, h, -1)
    # gate_up_proj_blocks [E, 2I, H / 32, 16] and _scales [E, 2I, H / 32]: rows 2n (gate n), 2n + 1 (up n)
    return lambda t: t.reshape(e, i, 2, -1).transpose(1, 2)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss causal LM over the paged KV cache (interface of `LlamaForCausalLM`), bf16 or MXFP4 experts
    (`quant_method: mxfp4`, the only quantized format read for gpt-oss); tensor and pipeline parallel."""

    supports_parallel = True
    supports_quantization = True
    config_cls = GptOssConfig
    make_layer = staticmethod(_make_layer)

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext = SINGLE) -> None:  # type: ignore[override]
        super().__init__(cfg, ctx)
        self.attention_factor = cfg.rope_attention_factor()
        self.expert_dims = (cfg.num_experts, cfg.intermediate_size, cfg.hidden_size)  # whole: the checkpoint's

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin, scaled by YaRN's attention factor as HF does."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)

    def stacked_tensor_part(self, name: str) -> Optional[StackedPart]:
        """The expert tensors (module docstring) are read whole and rearranged into the kernels' layout; under
        tensor parallelism this rank keeps its block of I, which is dim 2 of every rearranged tensor (MXFP4's
        `down_proj_blocks [E, H, I / 2]`: bytes of whole 32-input blocks, as `Mxfp4MoeMethod` checked)."""
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            return None
        try:
            self.get_parameter(name)
        except AttributeError:
            return None  # e.g. a bf16 tensor in an MXFP4 model: the loader names it
        shard = ShardSpec(2, self.ctx.tp_rank, self.ctx.tp_size) if self.ctx.tp_size > 1 else None
        return StackedPart(name, (), shard, 1, rearrange=_rearrangement(match.group(1), *self.expert_dims))
