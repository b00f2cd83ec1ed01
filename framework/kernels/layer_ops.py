"""Fused per-layer ops of the decoder: RMSNorm (+ residual add), SiLU-and-mul, q/k norm + RoPE + KV store.

Each op has a PyTorch reference (`*_reference`, the semantics, and what the model computed before the ops
were fused: same ops, same roundings to the tensor dtype as HF) and a Triton kernel doing it in one launch
(`framework/kernels/triton_norm_silu.py`, `framework/kernels/triton_qk_norm_rope.py`). The public functions
dispatch: Triton for CUDA tensors, the reference otherwise. `MRV2_ATTENTION_BACKEND=reference` forces the
references on CUDA too (the same switch as attention, so one variable bisects a numerical difference), and
`=triton` forces the kernels (on a CPU only under `TRITON_INTERPRET=1`). Inputs the kernels do not take
(another dtype, a weight of another dtype, a non-contiguous last dim, rows over 8192 elements, an odd
head_dim) silently take the reference, which handles everything; so does anything autograd must see
(training), as the kernels have no backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from framework.attention.backend import TRITON_HEAD_DIMS, attention_backend, store_kv
from framework.kernels.triton_norm_silu import MAX_RMS_NORM_DIM, rms_norm_triton, silu_and_mul_triton
from framework.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _triton_enabled(device: torch.device, *tensors: Optional[torch.Tensor]) -> bool:
    """Same choice as attention's (a head_dim the attention kernels take, so only the device and the env
    decide), except when autograd must see the op: the kernels have no backward, training takes the reference."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return attention_backend(device, TRITON_HEAD_DIMS[0]) == "triton"


def _fits(t: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    """None, or a tensor of `dtype` whose last dim is contiguous."""
    return t is None or (t.dtype == dtype and t.stride(-1) == 1)


# ---- references ----------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor,  # [T, D] (any leading dims)
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: Optional[torch.Tensor] = None,  # like x
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight * rmsnorm(x + residual), x + residual or None); the sum and the normalised row are rounded to
    x.dtype before use, as HF does."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), (x if residual is not None else None)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """silu(gate) * up of a merged gate/up projection (gate the first half of the columns)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope_reference(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> torch.Tensor:
    """x rotated by half-split RoPE (what the decoder applies to q and k, as HF does)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


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
) -> torch.Tensor:
    """q [T, H, D] (per-head RMSNorm when a weight is given, then RoPE); k (same) and raw v of the first T'
    tokens are written at their KV slots (`store_kv_reference` semantics, through the `store_kv` dispatcher)."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, eps)[0]
    if k_norm_weight is not None:
        k = rms_norm_reference(k, k_norm_weight, eps)[0]
    q, k = apply_rope_reference(q, cos, sin), apply_rope_reference(k, cos, sin)
    store_kv(k, v, kv_cache, kv_slot_mapping)  # the store's own dispatcher: no host sync on CUDA (graph capture)
    return q.contiguous()


# ---- dispatchers ---------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,  # [T, D] bf16/fp16/fp32, rows may be strided
    weight: torch.Tensor,  # [D] x.dtype
    eps: float,
    residual: Optional[torch.Tensor] = None,  # [T, D] x.dtype
    pdl: bool = False,  # the kernel with programmatic dependent launch (framework/kernels/pdl.py)
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight * rmsnorm(x + residual) [T, D], x + residual [T, D] or None); see `rms_norm_reference`."""
    kernel_takes = (x.dim() == 2 and x.dtype in TRITON_DTYPES and x.shape[1] <= MAX_RMS_NORM_DIM
                    and all(_fits(t, x.dtype) for t in (x, weight, residual)) and weight.shape == x.shape[1:]
                    and (residual is None or residual.shape == x.shape))
    if kernel_takes and _triton_enabled(x.device, x, weight, residual):
        return rms_norm_triton(x, weight, eps, residual, pdl)
    return rms_norm_reference(x, weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """silu(gate) * up of a merged gate/up projection; see `silu_and_mul_reference`."""
    kernel_takes = gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and _fits(gate_up, gate_up.dtype)
    if kernel_takes and gate_up.dtype in TRITON_DTYPES and _triton_enabled(gate_up.device, gate_up):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_reference(gate_up)


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
    pdl: bool = False,  # the kernel with programmatic dependent launch (framework/kernels/pdl.py)
) -> torch.Tensor:
    """q [T, H, D] contiguous, normed + roped; normed + roped k and raw v of the first T' tokens go to the
    cache. See `qk_norm_rope_store_reference`."""
    kernel_takes = (qkv.dim() == 2 and qkv.dtype in TRITON_DTYPES and head_dim % 2 == 0
                    and all(_fits(t, qkv.dtype) for t in (qkv, cos, sin, q_norm_weight, k_norm_weight))
                    and kv_cache.stride(-1) == 1 and kv_cache.stride(1) == kv_cache.shape[2] * kv_cache.stride(2))
    if kernel_takes and _triton_enabled(qkv.device, qkv, q_norm_weight, k_norm_weight):
        return qk_norm_rope_store_triton(qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads,
                                         num_kv_heads, head_dim, kv_cache, kv_slot_mapping, pdl)
    return qk_norm_rope_store_reference(qkv, cos, sin, q_norm_weight, k_norm_weight, eps, num_heads,
                                        num_kv_heads, head_dim, kv_cache, kv_slot_mapping)
