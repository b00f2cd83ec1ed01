"""FP8 x FP8 matmul through cuBLASLt (`torch._scaled_mm`) for weights scaled per output channel or per tensor.

cuBLASLt's FP8 GEMM takes one float32 scale per row of each operand ("row-wise" scaling): per token for the
activations, per output channel for the weight. That is exactly the compressed-tensors FP8_DYNAMIC layout and
online FP8 (`model.quantization=fp8`), and, with the scale broadcast, the per-tensor layouts (static
`input_scale`). Block-scaled FP8 (128 x 128 weight tiles, 128-input activation groups) has several scales along K
and stays on `triton_w8a8`.

Measured on one H100 at the Qwen3-8B projections (docs/benchmarks.md): cuBLASLt FP8 runs 1.3-1.7x cuBLAS bf16
from 256 tokens on (the merged gate/up projection from 1 token on), where `triton_w8a8` reached 0.3-0.8x of bf16.

Semantics are those of `triton_w8a8.w8a8_linear_reference` with one activation group and one weight group along
K: the dequantized activations times the dequantized weights, float32 accumulation (cuBLASLt's), rounded once to
bfloat16, the one output type row-wise scaling offers.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

FP8_MMA_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores
ALIGN = 16  # cuBLASLt's FP8 GEMM needs K and N multiples of 16 bytes


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def scaled_mm_layout(weight: torch.Tensor, sw: torch.Tensor, group_x: int) -> bool:
    """Whether row-wise scales express this layout: `weight` [N, K] with one scale per output channel or one per
    tensor (the grid `sw` is [N, 1] or [1, 1]), activations with one scale per token or per tensor (`group_x` = K),
    and K and N multiples of 16."""
    n, k = weight.shape
    return sw.shape[0] in (1, n) and sw.shape[1] == 1 and group_x == k and k % ALIGN == 0 and n % ALIGN == 0


def scaled_mm_applies(x: torch.Tensor, weight: torch.Tensor, sw: torch.Tensor, group_x: int) -> bool:
    """Whether `w8a8_linear_scaled_mm` serves x [M, K] (the 16-bit activations) times `weight`: a CUDA device with
    FP8 tensor cores, bfloat16 activations (the output type of row-wise scaling) and a `scaled_mm_layout`."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and scaled_mm_layout(weight, sw, group_x)):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _capability(index) >= FP8_MMA_CAPABILITY


def w8a8_linear_scaled_mm(
    xq: torch.Tensor,  # [M, K] float8_e4m3fn, contiguous
    sx: torch.Tensor,  # [M, 1] (per token) or [1, 1] (per tensor) float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    sw: torch.Tensor,  # [N, 1] (per channel) or [1, 1] (per tensor) float32
    bias: Optional[torch.Tensor] = None,  # [N]
) -> torch.Tensor:  # [M, N] bfloat16
    """`xq * sx` times `(weight * sw)^T` (+ bias) through `torch._scaled_mm` with row-wise scales."""
    m, n = xq.shape[0], weight.shape[0]
    scale_a = sx.reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = sw.reshape(1, -1).expand(1, n).contiguous()
    # weight.t() is the column-major [K, N] operand cuBLASLt wants, without a copy.
    y = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return y if bias is None else y + bias
