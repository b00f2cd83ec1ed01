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
activations each call), so groups are contiguous for the kernels. Up to `QUANT_GEMV_MAX_ROWS` tokens (16) the
small-M GEMV runs (`triton_w4a16_gemv`), above it the tensor-core GEMM (`triton_w4a16`); on the CPU the reference.
Tensor parallelism: `int4_parallel` (which tensors each rank splits, and the group layout of a row-parallel rank).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from framework.layers.kernels.backend import triton_enabled
from framework.layers.quantization.base import QuantizationError, QuantMethod, replace_parameter
from framework.layers.quantization.int4_parallel import gather_input, rank_group_layout, scatter_columns, split_dims
from framework.layers.quantization.triton_w4a16 import (
    pack_rows,
    unpack_rows,
    w4a16_linear_reference,
    w4a16_linear_triton,
)
from framework.layers.quantization.triton_w4a16_gemv import w4a16_gemv_triton
from framework.layers.quantization.triton_w8a16_gemv import QUANT_GEMV_MAX_ROWS

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column 8c + AWQ_ORDER[i]


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 tensor -> uint8 values 0..15, eight per int32 along `dim` (nibble i -> position 8c + order[i])."""
    nibbles = [((packed >> (4 * i)) & 0xF).to(torch.uint8) for i in range(8)]
    by_position = [nibbles[order.index(j)] for j in range(8)]
    stacked = torch.stack(by_position, dim=dim + 1)  # [..., C, 8, ...]
    shape = list(packed.shape)
    shape[dim] *= 8
    return stacked.reshape(shape)


def int4_tensor_shapes(
    layout: str, n: int, k: int, g: int, groups: Optional[int] = None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint tensors (name -> shape, dtype) of one [N, K] layer in `layout` with group size `g`; `groups`:
    the group tensors' length when not K / g (a row-parallel rank reads the whole layer's groups)."""
    groups = k // g if groups is None else groups
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

    def create_weights(self, layer: nn.Linear, prefix: str) -> None:
        ctx = getattr(layer, "ctx", None)
        tp, rank = (ctx.tp_size, ctx.tp_rank) if ctx is not None else (1, 0)
        dims = dict(getattr(layer, "shard_dims", {}))
        row = dims.pop("weight", 0) == 1 and tp > 1  # row-parallel: this rank holds K / tp input columns
        n, k = layer.out_features, layer.in_features
        full_k = k * tp if row else k
        g = full_k if self.group_size == -1 else self.group_size
        if k % 8 or n % 8:
            per_rank = f" per rank over {tp} tensor-parallel ranks" if tp > 1 else ""
            raise QuantizationError(
                f"{prefix}: {self.name} needs both dimensions a multiple of 8 (N={n}, K={k}{per_rank}): each int32 "
                "packs eight 4-bit values"
            )
        if full_k % g:
            raise QuantizationError(f"{prefix}: group size {g} does not divide the input dimension {full_k}")
        del layer._parameters["weight"]
        for name, (shape, dtype) in int4_tensor_shapes(self.layout, n, k, g, full_k // g).items():
            replace_parameter(layer, name, torch.empty(shape, dtype=dtype))
        dims.update({name: d for name, d in split_dims(self.layout, not row).items() if d is not None})
        layer.shard_dims = dims  # type: ignore[assignment]
        layer.int4_geometry = (tp, rank, row, g)  # type: ignore[assignment]

    def process_after_loading(self, layer: nn.Linear, prefix: str) -> None:
        n, k = layer.out_features, layer.in_features
        tp, rank, row, g = layer.int4_geometry  # type: ignore[misc]
        p = layer._parameters
        col_group: Optional[torch.Tensor] = None
        if self.layout == "gptq":
            q = unpack_int4(p["qweight"].data, 0).t()  # [N, K]
            zeros = unpack_int4(p["qzeros"].data, 1).t().float() + self.zero_offset  # [N, groups]
            scales = p["scales"].data.t().float()
            col_group = p["g_idx"].data.long()
            groups = scales.shape[1]
            in_range = bool((col_group >= 0).all()) and bool((col_group < groups).all())
            if not row and (not in_range or bool((torch.bincount(col_group, minlength=groups) != g).any())):
                raise QuantizationError(f"{prefix}.g_idx: each of the {groups} groups must hold {g} input columns")
        elif self.layout == "awq":
            q = unpack_int4(p["qweight"].data, 1, AWQ_ORDER).t()
            zeros = unpack_int4(p["qzeros"].data, 1, AWQ_ORDER).t().float()
            scales = p["scales"].data.t().float()
        else:
            full = [n, k * tp] if row else [n * tp, k]
            if p["weight_shape"].data.tolist() != full:
                raise QuantizationError(f"{prefix}.weight_shape: {p['weight_shape'].data.tolist()}, expected {full}")
            q = unpack_int4(p["weight_packed"].data, 1)
            scales = p["weight_scale"].data.float()
            zeros = torch.full_like(scales, 8.0)
        if col_group is None:  # groups of g consecutive inputs of the whole layer
            col_group = (torch.arange(k, device=q.device) + (rank * k if row else 0)) // g
        try:
            q, scales, zeros, perm, unit = rank_group_layout(q, col_group, scales, zeros, g)
        except ValueError as err:
            raise QuantizationError(f"{prefix}.g_idx: {err}") from None
        for name in list(p):
            if name != "bias":
                del p[name]
        replace_parameter(layer, "qweight", pack_rows(q.contiguous()))
        replace_parameter(layer, "scales", scales.contiguous())
        replace_parameter(layer, "zeros", zeros.contiguous())
        layer.register_buffer("perm", perm, persistent=False)
        layer.int4_group = unit  # type: ignore[assignment]

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:  # act-order / a row-parallel rank's groups: the activations in the weight's order
            flat = gather_input(flat, layer.perm)  # type: ignore[arg-type]
        args = (layer.qweight, layer.scales, layer.zeros, layer.int4_group)
        kernels = triton_enabled(x.device, x, backend=getattr(layer, "kernel_backend", "auto")) and flat.stride(-1) == 1
        decode = flat.shape[0] <= QUANT_GEMV_MAX_ROWS  # the weight-streaming GEMV
        if kernels and decode and layer.int4_group % 8 == 0:  # type: ignore[operator]
            y = w4a16_gemv_triton(flat, *args, bias)  # type: ignore[arg-type]
        elif kernels and layer.int4_group % 16 == 0:  # type: ignore[operator]
            y = w4a16_linear_triton(flat, *args, bias)  # type: ignore[arg-type]
        else:
            y = w4a16_linear_reference(flat, *args, bias)  # type: ignore[arg-type]
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantized_weight(self, layer: nn.Linear) -> torch.Tensor:
        g: int = layer.int4_group  # type: ignore[assignment]
        q = unpack_rows(layer.qweight).float()  # type: ignore[arg-type]
        weight = layer.scales.repeat_interleave(g, 1) * (q - layer.zeros.repeat_interleave(g, 1))  # type: ignore[operator]
        if layer.perm is not None:
            weight = scatter_columns(weight, layer.perm, layer.in_features)  # type: ignore[arg-type]
        return weight
