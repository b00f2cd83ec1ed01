"""The small-batch decode projections: one fused op, `fused_linear`, for every projection of a layer at M <= 16.

    qkv     = fused_linear(x, W_qkv, b, norm_weight=input_layernorm, residual=stream)   # add + RMSNorm + GEMV
    o       = fused_linear(attn, W_o)                                                   # GEMV
    act     = fused_linear(o, W_gate_up, norm_weight=post_attention_layernorm,
                           residual=stream, silu_mul=True)                              # add + RMSNorm + GEMV + SiLU*up
    down    = fused_linear(act, W_down)                                                 # GEMV
    logits  = fused_linear(hidden, W_lm_head, out_dtype=torch.float32)                  # GEMV

`fused_linear_reference` is the semantics: exactly the ops the default path runs (`rms_norm_reference`,
`F.linear`, `silu_and_mul_reference`), so the small-batch path is comparable with the default one and with HF.
`fused_linear` dispatches like the other layer ops (`framework/layers/kernels/layer_ops.py`): the Triton GEMV
(`framework/layers/kernels/triton_gemv.py`) for CUDA tensors, or on a CPU under `kernels.backend=triton` with
`TRITON_INTERPRET=1`; the reference otherwise (`kernels.backend=reference`, float64, more than 16 rows, a
non-contiguous weight, anything autograd must see).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from framework.layers.kernels.backend import kernel_fits, triton_enabled
from framework.layers.kernels.layer_ops import TRITON_DTYPES, rms_norm_reference, silu_and_mul_reference
from framework.layers.kernels.triton_gemv import MAX_GEMV_ROWS, gemv_triton


def fused_linear_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]; with silu_mul [2N, K] (gate rows, then up rows)
    bias: Optional[torch.Tensor] = None,  # [N] / [2N]
    norm_weight: Optional[torch.Tensor] = None,  # [K]: the product reads norm_weight * rmsnorm(x + residual)
    eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,  # [M, K] (only with norm_weight)
    silu_mul: bool = False,
    out_dtype: Optional[torch.dtype] = None,  # default weight.dtype
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out [M, N], x + residual [M, K] or None): `F.linear` of the (normed) input, then `silu(gate) * up` when
    `silu_mul`, cast to `out_dtype` at the end (after the rounding to the model dtype, as `.float()` of a
    bf16 projection)."""
    summed = None
    if norm_weight is not None:
        x, summed = rms_norm_reference(x, norm_weight, eps, residual)
    else:
        assert residual is None, "the residual add is part of the norm prologue"
    y = F.linear(x, weight, bias)
    if silu_mul:
        y = silu_and_mul_reference(y)
    return y.to(out_dtype or weight.dtype), summed


def fused_linear(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32, rows may be strided, last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous x.dtype; with silu_mul [2N, K]
    bias: Optional[torch.Tensor] = None,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,
    silu_mul: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    pdl: bool = False,  # the kernel with programmatic dependent launch (framework/layers/kernels/pdl.py)
    backend: str = "auto",  # kernels.backend (framework/layers/kernels/backend.py)
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out [M, N], x + residual [M, K] or None); see `fused_linear_reference`. `x + residual` is returned
    only when a residual is given (the first layer's stream is `x` itself)."""
    if silu_mul and weight.shape[0] % 2:
        raise ValueError(f"silu_mul needs a merged [2 * I, K] gate/up weight, got {tuple(weight.shape)}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    kernel_takes = (
        x.dtype in TRITON_DTYPES
        and x.shape[0] <= MAX_GEMV_ROWS
        and weight.is_contiguous()
        and all(kernel_fits(t, x.dtype) for t in (x, weight, bias, norm_weight, residual))
        and (residual is None or (norm_weight is not None and residual.shape == x.shape))
    )
    if kernel_takes and triton_enabled(x.device, x, weight, bias, norm_weight, residual, backend=backend):
        return gemv_triton(x, weight, bias, norm_weight, eps, residual, silu_mul, out_dtype, pdl=pdl)
    return fused_linear_reference(x, weight, bias, norm_weight, eps, residual, silu_mul, out_dtype)
