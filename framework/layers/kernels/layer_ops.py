"""Fused per-layer ops of the decoder: RMSNorm (+ residual add) and SiLU-and-mul (the fused q/k norm + RoPE +
KV store is attention's: framework/layers/attention/qk_norm_rope.py).

Each op has a PyTorch reference (`*_reference`, the semantics, and what the model computed before the ops
were fused: same ops, same roundings to the tensor dtype as HF) and a Triton kernel doing it in one launch
(`framework/layers/kernels/triton_norm_silu.py`, `framework/layers/kernels/triton_qk_norm_rope.py`). The
public functions dispatch: Triton for CUDA tensors, the reference otherwise. Their `backend="reference"`
(config key `kernels.backend`, handed down by the layers) forces the references on CUDA too (the same setting
as attention, so one switch bisects a numerical difference), and `"triton"` forces the kernels (on a CPU only
under `TRITON_INTERPRET=1`). Inputs the kernels do not take (another dtype, a weight of another dtype, a
non-contiguous last dim, rows over 8192 elements, an odd head_dim) silently take the reference, which handles
everything; so does anything autograd must see (training), as the kernels have no backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from framework.layers.kernels.backend import kernel_fits, triton_enabled
from framework.layers.kernels.triton_norm_silu import MAX_RMS_NORM_DIM, rms_norm_triton, silu_and_mul_triton

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---- references ----------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor,  # [T, D] (any leading dims)
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: Optional[torch.Tensor] = None,  # like x
    unit_offset: bool = False,
    float32_scale: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight * rmsnorm(x + residual), x + residual or None); the sum and the normalised row are rounded to
    x.dtype before use, as HF does. `unit_offset` (Gemma 3's norm): `(1 + weight) * rmsnorm` computed in float32
    and rounded once, as HF's Gemma norms do; `float32_scale` (Gemma 4's): `weight * rmsnorm` in float32, rounded
    once."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset or float32_scale:
        scale = 1.0 + weight.float() if unit_offset else weight.float()
        return (h * scale).to(x.dtype), (x if residual is not None else None)
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


# ---- dispatchers ---------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,  # [T, D] bf16/fp16/fp32, rows may be strided
    weight: torch.Tensor,  # [D] x.dtype
    eps: float,
    residual: Optional[torch.Tensor] = None,  # [T, D] x.dtype
    pdl: bool = False,  # the kernel with programmatic dependent launch (framework/layers/kernels/pdl.py)
    backend: str = "auto",  # kernels.backend (framework/layers/kernels/backend.py)
    unit_offset: bool = False,  # scale by (1 + weight) in float32 (Gemma 3): see `rms_norm_reference`
    float32_scale: bool = False,  # scale by weight in float32 (Gemma 4): see `rms_norm_reference`
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight * rmsnorm(x + residual) [T, D], x + residual [T, D] or None); see `rms_norm_reference`."""
    kernel_takes = (
        x.dim() == 2
        and x.dtype in TRITON_DTYPES
        and x.shape[1] <= MAX_RMS_NORM_DIM
        and all(kernel_fits(t, x.dtype) for t in (x, weight, residual))
        and weight.shape == x.shape[1:]
        and (residual is None or residual.shape == x.shape)
    )
    if kernel_takes and triton_enabled(x.device, x, weight, residual, backend=backend):
        return rms_norm_triton(x, weight, eps, residual, pdl, unit_offset, float32_scale)
    return rms_norm_reference(x, weight, eps, residual, unit_offset, float32_scale)


def silu_and_mul(gate_up: torch.Tensor, backend: str = "auto") -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """silu(gate) * up of a merged gate/up projection; see `silu_and_mul_reference`."""
    kernel_takes = gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and kernel_fits(gate_up, gate_up.dtype)
    if kernel_takes and gate_up.dtype in TRITON_DTYPES and triton_enabled(gate_up.device, gate_up, backend=backend):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_reference(gate_up)
