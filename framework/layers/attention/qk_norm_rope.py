"""q/k RMSNorm + RoPE + KV-cache store of a decoder layer, fused (its PyTorch reference and its dispatcher).

It sits with attention because its last step is attention's `store_kv`; the norms and the RoPE come from the
layer ops (`framework/layers/kernels/layer_ops.py`), the kernel from `framework/layers/kernels/triton_qk_norm_rope.py`.
"""

from __future__ import annotations

from typing import Optional

import torch

from framework.layers.attention.backend import store_kv
from framework.layers.kernels.backend import kernel_fits, triton_enabled
from framework.layers.kernels.layer_ops import TRITON_DTYPES, apply_rope_reference, rms_norm_reference
from framework.layers.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton


def qk_norm_rope_store_reference(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D]: q heads, then k heads, then v heads
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    q_norm_weight: Optional[torch.Tensor],  # [D] or None: no q norm
    k_norm_weight: Optional[torch.Tensor],  # [D] or None: no k norm
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], updated in place
    kv_slot_mapping: torch.Tensor,  # [T'] int64 KV slots of tokens 0..T'-1 (T' <= T), negative = padding
    backend: str = "auto",  # kernels.backend, for the store's dispatcher
    unit_offset: bool = False,  # the norms scale by (1 + weight) in float32 (Gemma 3; `rms_norm_reference`)
    float32_scale: bool = False,  # the norms scale by weight in float32 (Gemma 4; `rms_norm_reference`)
) -> torch.Tensor:
    """q [T, H, D] (per-head RMSNorm when a weight is given, then RoPE); k (same) and raw v of the first T'
    tokens are written at their KV slots (`store_kv_reference` semantics, through the `store_kv` dispatcher)."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, eps, unit_offset=unit_offset, float32_scale=float32_scale)[0]
    if k_norm_weight is not None:
        k = rms_norm_reference(k, k_norm_weight, eps, unit_offset=unit_offset, float32_scale=float32_scale)[0]
    q, k = apply_rope_reference(q, cos, sin), apply_rope_reference(k, cos, sin)
    store_kv(
        k, v, kv_cache, kv_slot_mapping, backend=backend
    )  # the store's own dispatcher: no host sync on CUDA (graph capture)
    return q.contiguous()


def qk_norm_rope_store(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D]: q heads, then k heads, then v heads
    cos: torch.Tensor,  # [T, D] qkv.dtype (cat([freqs, freqs]).cos())
    sin: torch.Tensor,  # [T, D] qkv.dtype
    q_norm_weight: Optional[torch.Tensor],  # [D] or None: no q norm (Llama); Qwen3 has one
    k_norm_weight: Optional[torch.Tensor],  # [D] or None
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], updated in place
    kv_slot_mapping: torch.Tensor,  # [T'] int64 KV slots of tokens 0..T'-1 (T' <= T), negative = padding
    pdl: bool = False,  # the kernel with programmatic dependent launch (framework/layers/kernels/pdl.py)
    backend: str = "auto",  # kernels.backend (framework/layers/kernels/backend.py)
    unit_offset: bool = False,  # the norms scale by (1 + weight) in float32, rounded once (Gemma 3)
    float32_scale: bool = False,  # the norms scale by weight in float32, rounded once (Gemma 4)
) -> torch.Tensor:
    """q [T, H, D] contiguous, normed + roped; normed + roped k and raw v of the first T' tokens go to the
    cache. See `qk_norm_rope_store_reference`."""
    kernel_takes = (
        qkv.dim() == 2
        and qkv.dtype in TRITON_DTYPES
        and head_dim % 2 == 0
        and all(kernel_fits(t, qkv.dtype) for t in (qkv, cos, sin, q_norm_weight, k_norm_weight))
        and kv_cache.stride(-1) == 1
        and kv_cache.stride(1) == kv_cache.shape[2] * kv_cache.stride(2)
    )
    if kernel_takes and triton_enabled(qkv.device, qkv, q_norm_weight, k_norm_weight, backend=backend):
        return qk_norm_rope_store_triton(
            qkv,
            cos,
            sin,
            q_norm_weight,
            k_norm_weight,
            eps,
            num_heads,
            num_kv_heads,
            head_dim,
            kv_cache,
            kv_slot_mapping,
            pdl,
            unit_offset=unit_offset,
            float32_scale=float32_scale,
        )
    return qk_norm_rope_store_reference(
        qkv,
        cos,
        sin,
        q_norm_weight,
        k_norm_weight,
        eps,
        num_heads,
        num_kv_heads,
        head_dim,
        kv_cache,
        kv_slot_mapping,
        backend,
        unit_offset,
        float32_scale,
    )
