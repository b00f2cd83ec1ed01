"""The small-batch path of a dense decoder layer and the LM head: the projections as fused GEMVs.

Per layer at M <= `SMALL_BATCH_MAX_TOKENS` (one) token (the default path's kernels in brackets):

    1. add + RMSNorm + qkv GEMV                 (add + RMSNorm, qkv GEMM)
    2. q/k norm + RoPE + KV store               (same kernel)
    3. paged attention (+ split-KV reduce)      (same kernels)
    4. o_proj GEMV                              (o_proj GEMM)
    5. add + RMSNorm + gate_up GEMV + SiLU*up   (add + RMSNorm, gate_up GEMM, silu_and_mul)
    6. down GEMV                                (down GEMM)

so 6-7 kernels instead of 9-10; the residual add of o_proj / down stays fused into the next norm, as on the
default path (the next prologue adds it). The layer and LM-head objects are the default path's: this module
reads their merged weights (`fuse_projections`) and calls their attention, so both paths share every parameter.

Tensor parallelism: q/k/v and gate/up are column shards (the GEMV reads this rank's rows, nothing to add);
o_proj and down are row shards, so the GEMV gives this rank's partial sum, which is all-reduced before the bias
(as `RowParallelLinear`); the LM head's vocabulary shard is all-gathered (as `ParallelLMHead`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from framework.layers.attention import AttentionMetadata
from framework.layers.kernels.small_batch_ops import fused_linear

# Forwards of at most this many tokens take the GEMVs when `kernels.small_batch` enables them. One: on the H200 the
# GEMV beats cuBLAS at one row and loses at eight (1e476a2:scripts/bench_gemv_tiles.py); the tensor-core kernel for 2-16
# rows lost too and is gone, and with it the `model.small_batch_max_tokens` key.
SMALL_BATCH_MAX_TOKENS = 1


def _row_parallel(
    linear: Any, x: torch.Tensor, pdl: bool = False, backend: str = "auto"
) -> torch.Tensor:  # [M, K / tp] -> [M, N]
    """`RowParallelLinear.forward` with the GEMV: one rank's bias goes into the kernel, shards sum first."""
    if linear.ctx.tp_size == 1:
        return fused_linear(x, linear.weight, linear.bias, pdl=pdl, backend=backend)[0]
    y = linear.ctx.tp_all_reduce(fused_linear(x, linear.weight, pdl=pdl, backend=backend)[0])
    return y if linear.bias is None else y + linear.bias


def small_batch_layer(
    layer: Any,  # a DecoderLayer after fuse_projections
    x: torch.Tensor,  # [M, hidden]: the previous layer's MLP output (the embedding for the first layer)
    residual: Optional[torch.Tensor],  # [M, hidden] stream before x is added; None: x is the stream
    cos: torch.Tensor,  # [M, head_dim]
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    attention: Any,  # AttentionFn
) -> tuple[torch.Tensor, torch.Tensor]:
    """(MLP output [M, hidden], residual stream [M, hidden]): `DecoderLayer.forward`'s contract. With
    `layer.programmatic_launch` every kernel here launches with PDL (framework/layers/kernels/pdl.py)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    pdl, backend = layer.programmatic_launch, layer.kernel_backend
    qkv, summed = fused_linear(
        x, attn.qkv_weight, attn.qkv_bias, norm.weight, norm.eps, residual, pdl=pdl, backend=backend
    )
    residual = x if summed is None else summed
    attended = attn.rope_store_attend(qkv, cos, sin, kv_cache, meta, attention, pdl)
    h = _row_parallel(attn.o_proj, attended, pdl, backend)
    act, summed = fused_linear(
        h,
        mlp.gate_up_weight,
        mlp.gate_up_bias,
        post.weight,
        post.eps,
        residual,
        silu_mul=True,
        pdl=pdl,
        backend=backend,
    )
    assert summed is not None
    return _row_parallel(mlp.down_proj, act, pdl, backend), summed


def small_batch_logits(
    lm_head: nn.Module,
    hidden: torch.Tensor,  # [L, hidden] -> [L, vocab]
    pdl: bool = False,
    backend: str = "auto",  # kernels.backend
) -> torch.Tensor:
    """`ParallelLMHead.forward` with the GEMV; a single rank writes float32 logits straight from the kernel (values
    rounded to the model dtype first, so the same as the model dtype's), tensor ranks gather the model dtype.
    `pdl`: launched with programmatic dependent launch."""
    ctx = lm_head.ctx
    single = ctx.tp_size == 1  # type: ignore[union-attr]
    weight: torch.Tensor = lm_head.weight  # type: ignore[assignment]
    logits = fused_linear(hidden, weight, out_dtype=torch.float32 if single else None, pdl=pdl, backend=backend)[0]
    if not single:
        logits = ctx.tp_all_gather_last_dim(logits)  # type: ignore[union-attr,operator]
    return logits[..., : lm_head.vocab_size]  # type: ignore[misc]


def enable_small_batch(model: nn.Module, max_tokens: int, programmatic_launch: bool = False) -> int:
    """Run forwards of at most `max_tokens` tokens (0: none) through the GEMVs, in every dense `DecoderLayer`
    and the LM head of `model` (both carry a `small_batch_max_tokens` attribute; MoE, Mamba and Whisper layers
    do not, and keep their path). Call after `fuse_projections`: the path reads the merged weights. Returns how
    many layers take it. `programmatic_launch`: that path's kernels (and the final norm before the LM head)
    launch with PDL; only where `framework.layers.kernels.pdl.pdl_supported` says they can."""
    layers = 0
    for module in model.modules():
        if not hasattr(module, "small_batch_max_tokens"):
            continue
        is_layer = hasattr(module, "self_attn")  # a DecoderLayer (else the LlamaForCausalLM: its LM head)
        if is_layer and any(getattr(m, "quant_method", None) is not None for m in module.modules()):
            continue  # quantized projections (not merged): the default path, whose linears run their methods
        if max_tokens and is_layer and (module.self_attn.qkv_weight is None or module.mlp.gate_up_weight is None):
            raise RuntimeError("enable_small_batch needs fuse_projections first (merged qkv / gate_up weights)")
        module.small_batch_max_tokens = max_tokens
        module.programmatic_launch = programmatic_launch and bool(max_tokens)
        layers += is_layer
    return layers if max_tokens else 0
