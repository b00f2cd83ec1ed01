"""4-bit integer weights (weight-only, W4A16): GPTQ, AWQ (GEMM packing) and compressed-tensors pack-quantized.

Each format stores 4-bit values packed eight to an int32, with per-group scales (and zero points) along the input
dimension; the layouts differ in what is packed along which dimension:

    format        checkpoint tensors (per linear layer; G = group size, / rounds up)         weight value
    GPTQ (v1)     qweight [K/8, N] (8 input rows per int32), qzeros [K/G, N/8] (stored    s * (q - (z + 1))
                  minus 1), scales [K/G, N], g_idx [K] (the group of each input column;
                  act-order `desc_act` checkpoints permute it)
    AWQ (GEMM)    qweight [K, N/8], qzeros [K/G, N/8] (8 output columns per int32, nibble    s * (q - z)
                  i holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]), scales [K/G, N]
    c-t W4A16     weight_packed [N, K/8] (8 input columns per int32), weight_scale [N, K/G],  s * (q - 8)
                  weight_shape [2]; symmetric (signed values stored with +8)

Nibble i of an int32 is bits 4i..4i+3. After loading, every format becomes the layout of `triton_w4a16`: `qweight`
int32 `[N, K / 8]` (eight consecutive input columns per int32), float32 `scales` and `zeros` `[N, K / G]`. GPTQ's
act-order (`g_idx` not `k // G`) is undone at load by sorting the input columns by group (`perm`, applied to the
activations each call), so groups are contiguous for the kernel. Small M and large M both run the Triton kernel
(CPU: its PyTorch reference). Tensor parallelism is refused for INT4 layers (group and act-order splits not built).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from framework.layers.kernels.backend import triton_enabled
from framework.layers.quantization.base import QuantizationError, QuantMethod, replace_parameter
from framework.layers.quantization.triton_w4a16 import (
    pack_rows,
    unpack_rows,
    w4a16_linear_reference,
    w4a16_linear_triton,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column 8c + AWQ_ORDER[i]


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 tensor -> uint8 values 0..15, eight per int32 along `dim` (nibble i -> position 8c + order[i])."""
    nibbles = [((packed >> (4 * i)) & 0xF).to(torch.uint8) for i in range(8)]
    by_position = [nibbles[order.index(j)] for j in range(8)]
    stacked = torch.stack(by_position, dim=dim + 1)  # [..., C, 8, ...]
    shape = list(packed.shape)
    shape[dim] *= 8
    return stacked.reshape(shape)


def int4_tensor_shapes(layout: str, n: int, k: int, g: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint tensors (name -> shape, dtype) of one [N, K] layer in `layout` with group size `g`."""
    groups = k // g
    if layout == "gptq":
        return {
            "qweight": ((k // 8, n), torch.int32),
            "qzeros": ((groups, n // 8), torch.int32),
            "scales": ((groups, n), torch.float32),
            "g_idx": ((k,), torch.int32),
        }
    if layout == "awq":
        return {
            "qweight": ((k, n // 8), torch.int32),
            "qzeros": ((groups, n // 8), torch.int32),
            "scales": ((groups, n), torch.float32),
        }
    return {
        "weight_packed": ((n, k // 8), torch.int32),
        "weight_scale": ((n, groups), torch.float32),
        "weight_shape": ((2,), torch.int64),
    }


class Int4Method(QuantMethod):
    """One INT4 format (`layout`: "gptq", "awq" or "ct") with group size `group_size` (-1: the whole row)."""

    def __init__(self, layout: str, group_size: int, sym: bool = True, zero_offset: int = 1) -> None:
        self.name = f"int4-{layout}"  # type: ignore[misc]
        self.layout, self.group_size, self.sym = layout, group_size, sym
        self.zero_offset = zero_offset  # GPTQ v1 stores zero - 1

    def _shapes(self, layer: nn.Linear, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, k = layer.out_features, layer.in_features
        g = k if self.group_size == -1 else self.group_size
        ctx = getattr(layer, "ctx", None)
        if ctx is not None and ctx.tp_size > 1:
            raise QuantizationError(f"{prefix}: {self.name} weights under tensor parallelism are not supported yet")
        if k % 8 or n % 8:
            raise QuantizationError(f"{prefix}: {self.name} needs both dimensions a multiple of 8 (N={n}, K={k})")
        if k % g:
            raise QuantizationError(f"{prefix}: group size {g} does not divide the input dimension {k}")
        return int4_tensor_shapes(self.layout, n, k, g)

    def create_weights(self, layer: nn.Linear, prefix: str) -> None:
        shapes = self._shapes(layer, prefix)
        del layer._parameters["weight"]
        for name, (shape, dtype) in shapes.items():
            replace_parameter(layer, name, torch.empty(shape, dtype=dtype))
        layer.shard_dims = {}  # type: ignore[assignment]

    def process_after_loading(self, layer: nn.Linear, prefix: str) -> None:
        n, k = layer.out_features, layer.in_features
        g = k if self.group_size == -1 else self.group_size
        p = layer._parameters
        perm: Optional[torch.Tensor] = None
        if self.layout == "gptq":
            q = unpack_int4(p["qweight"].data, 0).t()  # [N, K]
            zeros = unpack_int4(p["qzeros"].data, 1).t().float() + self.zero_offset  # [N, groups]
            scales = p["scales"].data.t().float()
            g_idx = p["g_idx"].data.long()
            if g_idx.min() < 0 or g_idx.max() >= k // g or bool((torch.bincount(g_idx, minlength=k // g) != g).any()):
                raise QuantizationError(f"{prefix}.g_idx: each of the {k // g} groups must hold {g} input columns")
            if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // g):  # act-order: sort by group
                perm = torch.argsort(g_idx, stable=True)
                q = q[:, perm]
        elif self.layout == "awq":
            q = unpack_int4(p["qweight"].data, 1, AWQ_ORDER).t()
            zeros = unpack_int4(p["qzeros"].data, 1, AWQ_ORDER).t().float()
            scales = p["scales"].data.t().float()
        else:
            if tuple(p["weight_shape"].data.tolist()) != (n, k):
                raise QuantizationError(f"{prefix}.weight_shape: {p['weight_shape'].data.tolist()}, expected {[n, k]}")
            q = unpack_int4(p["weight_packed"].data, 1)
            scales = p["weight_scale"].data.float()
            zeros = torch.full_like(scales, 8.0)
        for name in list(p):
            if name != "bias":
                del p[name]
        replace_parameter(layer, "qweight", pack_rows(q.contiguous()))
        replace_parameter(layer, "scales", scales.contiguous())
        replace_parameter(layer, "zeros", zeros.contiguous())
        layer.register_buffer("perm", perm, persistent=False)
        layer.int4_group = g  # type: ignore[assignment]

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:  # act-order: the activations follow the sorted weight columns
            flat = flat[:, layer.perm]
        args = (layer.qweight, layer.scales, layer.zeros, layer.int4_group)
        use_kernel = layer.int4_group % 16 == 0 and flat.stride(-1) == 1  # type: ignore[operator]
        if use_kernel and triton_enabled(x.device, x, backend=getattr(layer, "kernel_backend", "auto")):
            y = w4a16_linear_triton(flat, *args, bias)  # type: ignore[arg-type]
        else:
            y = w4a16_linear_reference(flat, *args, bias)  # type: ignore[arg-type]
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantized_weight(self, layer: nn.Linear) -> torch.Tensor:
        g: int = layer.int4_group  # type: ignore[assignment]
        q = unpack_rows(layer.qweight).float()  # type: ignore[arg-type]
        weight = layer.scales.repeat_interleave(g, 1) * (q - layer.zeros.repeat_interleave(g, 1))  # type: ignore[operator]
        if layer.perm is not None:
            weight = weight[:, torch.argsort(layer.perm)]  # type: ignore[arg-type]
        return weight
