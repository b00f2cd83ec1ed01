"""Gated RMSNorm of Gated DeltaNet's output: `norm(x) * weight * silu(gate)`, per head row.

Semantics are HF's `RMSNormGated` (Qwen3-Next, Qwen3.5): the row is normalised in float32, rounded to the input
dtype, multiplied by the weight, then by `silu(gate)` in float32, and rounded to the input dtype again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import next_power_of_2


def gated_rms_norm_reference(
    x: torch.Tensor,  # [N, D] model dtype (one row per token and value head)
    gate: torch.Tensor,  # [N, D]
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    """[N, D] in x's dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed).float() * torch.nn.functional.silu(gate.float())).to(x.dtype)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    out_ptr,  # [N, D] contiguous
    w_ptr,  # [D]
    dim,
    eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    y = x * rstd * w * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[N, D]: one program per row, the row in registers (float32 throughout, one rounding at the end)."""
    if x.shape != gate.shape or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x {list(x.shape)}, gate {list(gate.shape)} and weight {list(weight.shape)} disagree")
    x, gate = x.contiguous(), gate.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _gated_rms_norm_kernel[(x.shape[0],)](
            x, gate, out, weight, x.shape[1], eps, BLOCK_D=next_power_of_2(x.shape[1])
        )
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch: Triton for CUDA tensors, the reference elsewhere."""
    fn = gated_rms_norm_triton if x.is_cuda else gated_rms_norm_reference
    return fn(x, gate, weight, eps)
