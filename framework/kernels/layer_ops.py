"""Fused per-layer ops of the decoder (placeholder: references only, Triton arrives from branch layer-ops)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from framework.attention.backend import store_kv


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), (x if residual is not None else None)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def qk_norm_rope_store_reference(qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads, num_kv_heads,
                                 head_dim, kv_cache, kv_slot_mapping):  # type: ignore[no-untyped-def]
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, eps)[0]
    if k_norm_weight is not None:
        k = rms_norm_reference(k, k_norm_weight, eps)[0]
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    store_kv(k, v, kv_cache, kv_slot_mapping)  # Triton on CUDA: no host sync (graph capture)
    return q.contiguous()


rms_norm = rms_norm_reference
silu_and_mul = silu_and_mul_reference
qk_norm_rope_store = qk_norm_rope_store_reference
