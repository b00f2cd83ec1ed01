"""FP8 weights: the block-scaled, per-channel and per-tensor layouts, and online FP8 of a 16-bit checkpoint.

Every layout is an FP8 e4m3 weight `[N, K]` with a grid of float32 scales, one per `group_n x group_k` tile
(`triton_w8a16`'s module docstring lists the groups), so one method class and one kernel serve them all; the
layouts differ only in the scale tensor's checkpoint name and shape, and in how tensor parallelism splits it:

    layout             checkpoint tensors (per linear layer)                    column split      row split
    block (HF "fp8")   weight [N, K] e4m3, weight_scale_inv [N/bn, K/bk] f32     scale dim 0       scale dim 1
    block (c-t)        weight, weight_scale [N/bn, K/bk]                        scale dim 0       scale dim 1
    channel (c-t)      weight, weight_scale [N, 1]                              scale dim 0       whole
    tensor (c-t)       weight, weight_scale [1] (+ input_scale [1])             whole             whole

("c-t": compressed-tensors; `/` rounds up.) Below `W8A8_MIN_TOKENS` tokens (decode) and on the CPU, activations
stay in the model dtype (W8A16: the result is that of the dequantized weights). From `W8A8_MIN_TOKENS` tokens on,
on the GPU, the activations are quantized as the checkpoint declares (per token and 128-input group for block FP8,
per token for FP8_DYNAMIC and online FP8, the static `input_scale` for per-tensor FP8) and the FP8 x FP8 GEMM runs:
cuBLASLt's (`scaled_mm_w8a8`) for per-channel and per-tensor weights in bfloat16 models, `triton_w8a8` otherwise.
Up to `QUANT_GEMV_MAX_ROWS` tokens (16) W8A16 runs the small-M GEMV (`triton_w8a16_gemv`), above it the tensor-core
GEMM (`triton_w8a16`).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from framework.layers.kernels.backend import triton_enabled
from framework.layers.kernels.launch_math import cdiv
from framework.layers.quantization.base import FP8_DTYPE, FP8_MAX, QuantizationError, QuantMethod, replace_parameter
from framework.layers.quantization.scaled_mm_w8a8 import scaled_mm_applies, w8a8_linear_scaled_mm
from framework.layers.quantization.triton_w8a8 import quantize_fp8_groups, quantize_fp8_static, w8a8_linear_triton
from framework.layers.quantization.triton_w8a16 import (
    dequantize_fp8,
    w8a16_linear_reference,
    w8a16_linear_triton,
)
from framework.layers.quantization.triton_w8a16_gemv import QUANT_GEMV_MAX_ROWS, w8a16_gemv_triton

# Token count from which FP8 layers quantize their activations and run the FP8 x FP8 GEMM (`triton_w8a8`); below
# it the W8A16 kernel (16-bit activations) runs. Decode is bound by reading the weight, which both paths read once;
# prefill is bound by tensor-core throughput, which FP8 doubles. `benchmarks/quantization/bench_fp8_linear.py`
# measures the crossing point.
W8A8_MIN_TOKENS = 128


def _split_dims(layer: nn.Module) -> tuple[int, int]:
    """(tensor-parallel ranks, 0 for a column-parallel layer / 1 for a row-parallel one)."""
    ctx = getattr(layer, "ctx", None)
    tp = ctx.tp_size if ctx is not None else 1
    return tp, int(getattr(layer, "shard_dims", {}).get("weight", 0))


class Fp8LinearMethod(QuantMethod):
    """An FP8 e4m3 weight with group scales named `scale_name`; `group` = (group_n, group_k), None meaning the
    whole dimension (per-channel: (1, None); per-tensor: (None, None); block: (128, 128))."""

    def __init__(
        self,
        name: str,
        scale_name: str,
        group: tuple[Optional[int], Optional[int]],
        input_scale: bool = False,
        activation: str = "token",
        w8a8_min_tokens: Optional[int] = W8A8_MIN_TOKENS,
    ) -> None:
        self.name = name  # type: ignore[misc]
        self.scale_name = scale_name
        self.group = group
        self.input_scale = input_scale
        # How the checkpoint quantizes activations: "group" (per token, groups of group_k inputs: block FP8),
        # "token" (FP8_DYNAMIC, online FP8) or "static" (the checkpoint's input_scale).
        self.activation = "static" if input_scale else activation
        self.w8a8_min_tokens = w8a8_min_tokens  # None: 16-bit activations at every size

    def groups(self, layer: nn.Linear) -> tuple[int, int]:
        """(group_n, group_k) of this rank's weight."""
        n, k = layer.out_features, layer.in_features
        return self.group[0] or n, self.group[1] or k

    def scale_shape(self, layer: nn.Linear) -> tuple[int, ...]:
        """The scale tensor's shape as the checkpoint stores it (this rank's part)."""
        if self.group == (None, None):
            return (1,)
        group_n, group_k = self.groups(layer)
        return (cdiv(layer.out_features, group_n), cdiv(layer.in_features, group_k))

    def create_weights(self, layer: nn.Linear, prefix: str) -> None:
        tp, split = _split_dims(layer)
        n, k = layer.out_features, layer.in_features
        if tp > 1 and split == 0 and self.group[0] is not None and n % self.group[0]:
            raise QuantizationError(
                f"{prefix}: {n} output features per rank is not a multiple of the {self.name} block "
                f"{self.group[0]}: the scales cannot be split over {tp} tensor-parallel ranks"
            )
        if tp > 1 and split == 1 and self.group[1] is not None and k % self.group[1]:
            raise QuantizationError(
                f"{prefix}: {k} input features per rank is not a multiple of the {self.name} block "
                f"{self.group[1]}: the scales cannot be split over {tp} tensor-parallel ranks"
            )
        replace_parameter(layer, "weight", torch.empty((n, k), dtype=FP8_DTYPE))
        replace_parameter(layer, self.scale_name, torch.empty(self.scale_shape(layer), dtype=torch.float32))
        if self.input_scale:
            replace_parameter(layer, "input_scale", torch.empty((1,), dtype=torch.float32))
        dims = dict(getattr(layer, "shard_dims", {}))
        if self.group[0] is not None and split == 0:  # per-channel or block scales follow the output rows
            dims[self.scale_name] = 0
        if self.group[1] is not None and split == 1:  # block scales follow the input columns
            dims[self.scale_name] = 1
        layer.shard_dims = dims  # type: ignore[assignment]

    def scale_grid(self, layer: nn.Linear) -> torch.Tensor:
        """The scales as the [ceil(N / group_n), ceil(K / group_k)] float32 grid the kernel reads."""
        scale: torch.Tensor = getattr(layer, self.scale_name)
        return scale.view(1, 1) if scale.dim() == 1 else scale

    def process_after_loading(self, layer: nn.Linear, prefix: str) -> None:
        scale = self.scale_grid(layer)
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise QuantizationError(f"{prefix}.{self.scale_name}: scales must be finite and positive")

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        group_n, group_k = self.groups(layer)
        flat = x.reshape(-1, x.shape[-1])
        kernels = triton_enabled(x.device, x, backend=getattr(layer, "kernel_backend", "auto")) and flat.stride(-1) == 1
        w8a8 = self.w8a8_min_tokens is not None and flat.shape[0] >= self.w8a8_min_tokens
        if kernels and w8a8:
            y = self.apply_w8a8(layer, flat, bias)
        elif kernels and flat.shape[0] <= QUANT_GEMV_MAX_ROWS:  # decode: the weight-streaming GEMV
            y = w8a16_gemv_triton(flat, layer.weight, self.scale_grid(layer), group_n, group_k, bias)
        elif kernels:
            y = w8a16_linear_triton(flat, layer.weight, self.scale_grid(layer), group_n, group_k, bias)
        else:
            y = w8a16_linear_reference(flat, layer.weight, self.scale_grid(layer), group_n, group_k, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def quantize_input(self, layer: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """x [M, K] -> (e4m3 [M, K], float32 scales [M or 1, K / group], group) as the checkpoint declares."""
        k = x.shape[-1]
        if self.activation == "static":
            return (*quantize_fp8_static(x, layer.input_scale), k)
        group = self.groups(layer)[1] if self.activation == "group" else k
        return (*quantize_fp8_groups(x, group, use_kernel=x.is_cuda), group)

    def apply_w8a8(self, layer: nn.Linear, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """[M, K] -> [M, N]: the activations quantized to FP8 (`quantize_input`), then the FP8 x FP8 GEMM: cuBLASLt's
        where its row-wise scales express the layout (`scaled_mm_w8a8`), `triton_w8a8` otherwise."""
        xq, sx, group_x = self.quantize_input(layer, x)
        if scaled_mm_applies(x, layer.weight, self.scale_grid(layer), group_x):
            return w8a8_linear_scaled_mm(xq, sx, layer.weight, self.scale_grid(layer), bias)
        upcast = os.environ.get("TRITON_INTERPRET") == "1"  # numpy has no FP8 product
        args = (xq, sx, group_x, layer.weight, self.scale_grid(layer), *self.groups(layer), x.dtype, bias)
        return w8a8_linear_triton(*args, upcast=upcast)

    def dequantized_weight(self, layer: nn.Linear) -> torch.Tensor:
        return dequantize_fp8(layer.weight, self.scale_grid(layer), *self.groups(layer))


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """16/32-bit weight [N, K] -> (e4m3 weight [N, K], float32 scales [N, 1]): each row's largest magnitude maps to
    448, the largest e4m3 value (an all-zero row gets scale 1)."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class OnlineFp8Method(Fp8LinearMethod):
    """`model.quantization=fp8`: the checkpoint's 16-bit weight loads as usual, then becomes FP8 with one scale per
    output channel (under tensor parallelism: per channel of this rank's part)."""

    def __init__(self) -> None:
        super().__init__("online-fp8", "weight_scale", (1, None))

    def create_weights(self, layer: nn.Linear, prefix: str) -> None:
        """Nothing: the layer keeps its 16-bit weight until `process_after_loading`."""

    def process_after_loading(self, layer: nn.Linear, prefix: str) -> None:
        weight, scale = quantize_fp8_per_channel(layer.weight.data)
        replace_parameter(layer, "weight", weight)
        replace_parameter(layer, "weight_scale", scale)
