"""The default path's projections: `F.linear` (cuBLAS), or the split-K Triton GEMM for forwards of few tokens.

    qkv  = project(x, W_qkv, b, split_k=attn.split_k)                  # Attention.forward
    act  = project(h, W_gate_up, b, silu_mul=True, split_k=mlp.split_k)  # MLP.forward: GEMM + SiLU * up
    o    = project(attn, W_o, split_k=o_proj.split_k)                  # RowParallelLinear.forward

A module's `split_k` (a `SplitKProjections`, set by `models.llama.enable_split_k_projections`; None: cuBLAS
always) says up to how many tokens its forwards take the kernel (`framework/kernels/triton_gemm.py`); the choice
reads only the shape, so a CUDA graph captured at a padded batch size freezes one path. Larger forwards
(prefill) and what the kernel does not take (float64, a non-contiguous weight, anything autograd must see) run
`F.linear` (then `silu_and_mul`), the semantics both paths share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn import functional as F

from framework.kernels.layer_ops import TRITON_DTYPES, _fits, _triton_enabled, silu_and_mul
from framework.kernels.split_counters import SplitCounters
from framework.kernels.triton_gemm import gemm_triton


@dataclass(frozen=True)
class SplitKProjections:
    """Forwards of at most `max_tokens` tokens run a module's projections through the split-K GEMM; `counters`
    is the kernel's state between launches (one per model, shared by its projections: they run one at a time)."""

    max_tokens: int
    counters: SplitCounters


def project(
    x: torch.Tensor,  # [M, K], last dim contiguous
    weight: torch.Tensor,  # [N, K]; with silu_mul [2N, K] (gate rows, then up rows)
    bias: Optional[torch.Tensor] = None,  # [N] / [2N]
    silu_mul: bool = False,
    split_k: Optional[SplitKProjections] = None,
) -> torch.Tensor:  # [M, N]
    """`F.linear(x, weight, bias)`, then `silu(gate) * up` with `silu_mul`; through the split-K GEMM when
    `split_k` takes x's token count and the kernel takes the tensors."""
    if split_k is not None and 0 < x.shape[0] <= split_k.max_tokens and _kernel_takes(x, weight, bias):
        return gemm_triton(x, weight, bias, silu_mul, split_k.counters)
    y = F.linear(x, weight, bias)
    return silu_and_mul(y) if silu_mul else y


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    return (x.dim() == 2 and weight.dim() == 2 and x.dtype in TRITON_DTYPES and weight.is_contiguous()
            and all(_fits(t, x.dtype) for t in (x, weight, bias)) and _triton_enabled(x.device, x, weight, bias))
