"""Quantized MoE experts: the checkpoint's per-expert tensors, stacked per projection, read by the fused MoE kernels.

A layer's experts module (`framework.models.moe.StackedExperts`: `gate_up_proj [E, 2, I, H]`, `down_proj [E, H, I]`)
takes the method of its experts' linear layers (the scheme's choice for `experts.0.gate_proj`), in three moments as
a `QuantMethod`:

1. `create_weights`: one stacked parameter per checkpoint tensor name and projection, filled expert by expert by the
   loader (`experts.{e}.gate_proj.weight_scale_inv` -> `gate_up_proj_weight_scale_inv[e, 0]`, `...down_proj.qweight`
   -> `down_proj_qweight[e]`; the weight itself keeps the names `gate_up_proj` / `down_proj`);
2. `process_after_loading`: checks the scales and builds the kernels' `QuantExperts`
   (`framework/layers/kernels/fused_moe_quant.py`): FP8 stays as stored (any block, channel or tensor grid), every
   INT4 format becomes int32 words of eight inputs with float32 scales and zero points;
3. `apply`: the fused MoE over the quantized weights; FP8 experts from `MOE_W8A8_MIN_TOKENS` tokens on quantize
   their activations too and run FP8 x FP8 (`triton_moe_w8a8.py`).

Tensor parallelism splits every expert's intermediate dimension I as for 16-bit experts: gate/up are
column-parallel (their output rows), down row-parallel (its input columns); `create_weights` names in
`checkpoint_split` which dim of each per-expert checkpoint tensor the loader splits (None: read whole). The scales
split with the weight, so I per rank must be a multiple of the FP8 block (128) and of the INT4 group.

MXFP4 (gpt-oss) keeps the checkpoint's bytes and E8M0 exponents (`gate_up_proj_blocks [E, 2, I, H / 2]` uint8,
`..._scales [E, 2, I, H / 32]`, `down_proj_blocks [E, H, I / 2]`, `down_proj_scales [E, H, I / 32]`; the model
de-interleaves gpt-oss's gate/up rows at load), dequantized in the kernels' registers. Under tensor parallelism all
four split on I (dim 2): gate/up's rows, and down's inputs in whole blocks of 32 (16 bytes, one exponent).

Refused by name: FP8 blocks, INT4 groups or MXFP4 blocks that I per rank cuts in two, GPTQ act-order (a
permutation per expert).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from framework.layers.kernels.backend import triton_enabled
from framework.layers.kernels.fused_moe import TRITON_DTYPES
from framework.layers.kernels.fused_moe_quant import QuantExperts, fused_moe_quant, warm_fused_moe_quant
from framework.layers.kernels.moe_epilogue import MXFP4_GROUP, SILU_EPILOGUE, MoeEpilogue
from framework.layers.quantization.base import QuantizationError, QuantMethod, replace_parameter
from framework.layers.quantization.fp8 import Fp8LinearMethod, OnlineFp8Method, quantize_fp8_per_channel
from framework.layers.quantization.int4 import AWQ_ORDER, Int4Method, int4_tensor_shapes, unpack_int4
from framework.layers.quantization.int4_parallel import split_dims
from framework.layers.quantization.triton_moe_w8a8 import fused_moe_w8a8_triton, moe_w8a8_fits
from framework.layers.quantization.triton_w4a16 import pack_rows

PROJECTIONS = ("gate_up_proj", "down_proj")

# Token count from which FP8 experts quantize their activations and run FP8 x FP8 grouped GEMMs
# (`triton_moe_w8a8`; dynamic activation schemes, on the GPU); below it the W8A16 kernels run. Measured on an H100
# at the Qwen3-30B-A3B experts (`benchmarks/quantization/bench_fp8_moe.py`, docs/benchmarks.md): W8A16 leads up to
# 64 tokens (0.32 against 0.38 ms a layer), W8A8 from 256 on (0.40 against 0.45 ms; 1.2-1.4x bf16 up to 8,192).
MOE_W8A8_MIN_TOKENS = 256


def _dims(experts: nn.Module) -> tuple[int, int, int]:
    """(E, I, H) of this rank's experts (`expert_dims`, which outlives the 16-bit parameters)."""
    e, i, h = experts.expert_dims
    return int(e), int(i), int(h)


def _lead(experts: nn.Module, proj: str) -> tuple[int, ...]:
    """Leading dims of a stacked projection: (E, 2) for gate/up, (E,) for down."""
    e = _dims(experts)[0]
    return (e, 2) if proj == "gate_up_proj" else (e,)


def _nk(experts: nn.Module, proj: str) -> tuple[int, int]:
    """(output N, input K) of one expert's projection."""
    _, i, h = _dims(experts)
    return (i, h) if proj == "gate_up_proj" else (h, i)


def _parallel(experts: nn.Module) -> tuple[int, int]:
    """(tensor-parallel ranks, this rank) of an experts module."""
    ctx = getattr(experts, "ctx", None)
    return (ctx.tp_size, ctx.tp_rank) if ctx is not None else (1, 0)


def _refuse_cut(experts: nn.Module, prefix: str, what: str, size: int) -> None:
    """Refuse when I per rank (under tensor parallelism) is not a multiple of `size` (an FP8 block, an INT4 group,
    an MXFP4 block), naming the config key of I (`intermediate_key`: gpt-oss says `intermediate_size`)."""
    tp, _ = _parallel(experts)
    i = _dims(experts)[1]
    key = getattr(experts, "intermediate_key", "moe_intermediate_size")
    if tp > 1 and i % size:
        raise QuantizationError(
            f"{prefix}: {i} intermediate features per rank ({key} {i * tp} over {tp} tensor-parallel "
            f"ranks) is not a multiple of the {what} {size}: the experts' scales cannot be split with their weights"
        )


def _per_rank(experts: nn.Module) -> str:
    tp, _ = _parallel(experts)
    return f", per rank over {tp} tensor-parallel ranks" if tp > 1 else ""


def stacked_name(proj: str, tensor: str) -> str:
    """The stacked parameter that checkpoint tensor `tensor` (`weight`, `weight_scale_inv`, `qzeros`, ...) of every
    expert's `proj` fills."""
    return proj if tensor == "weight" else f"{proj}_{tensor}"


class MoeQuantMethod(QuantMethod):
    """Quantized stacked experts (module docstring); `apply` takes the routing as well."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise TypeError("quantized experts run through apply_experts (they need the routing)")

    def apply_experts(
        self,
        experts: nn.Module,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        backend: str,
        epilogue: MoeEpilogue = SILU_EPILOGUE,
    ) -> torch.Tensor:
        """[T, H] -> [T, H]: the MoE MLP of `x` routed to experts `ids` with `weights` ([T, top-k])."""
        return fused_moe_quant(x, experts.quant_experts, weights, ids, backend, epilogue)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        from framework.layers.kernels.fused_moe_quant import dequantize_experts

        return dequantize_experts(layer.quant_experts)[0]


class Fp8MoeMethod(MoeQuantMethod):
    """FP8 e4m3 experts with the linear method's scale grid (`linear.group`, scale name, static input scales)."""

    def __init__(self, linear: Fp8LinearMethod, w8a8_min_tokens: Optional[int] = MOE_W8A8_MIN_TOKENS) -> None:
        self.name = f"{linear.name}-moe"  # type: ignore[misc]
        self.linear = linear
        self.w8a8_min_tokens = w8a8_min_tokens  # None: 16-bit activations at every size

    def apply_experts(
        self,
        experts: nn.Module,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        backend: str,
        epilogue: MoeEpilogue = SILU_EPILOGUE,
    ) -> torch.Tensor:
        """W8A8 (FP8 activations, per token and 128-input group for block FP8, per token for per-channel and online
        FP8) from `w8a8_min_tokens` tokens on, with the kernels; W8A16 below, on the CPU, for static input scales
        and for groups along K that are not multiples of 32 (`moe_w8a8_fits`)."""
        group = self.linear.group[1] if self.linear.activation == "group" else None
        if (
            self.w8a8_min_tokens is not None
            and x.shape[0] >= self.w8a8_min_tokens
            and self.linear.activation != "static"
            and x.dtype in TRITON_DTYPES
            and x.stride(-1) == 1
            and triton_enabled(x.device, x, backend=backend)
            and moe_w8a8_fits(experts.quant_experts, group)
        ):
            # The W8A16 kernels below `w8a8_min_tokens` compile now, at a large (warm-up) batch, not in a step.
            warm_fused_moe_quant(x, experts.quant_experts, weights, ids, epilogue)
            return fused_moe_w8a8_triton(x, experts.quant_experts, weights, ids, group, epilogue=epilogue)
        return super().apply_experts(experts, x, weights, ids, backend, epilogue)

    def _groups(self, experts: nn.Module, proj: str) -> tuple[int, int]:
        n, k = _nk(experts, proj)
        return self.linear.group[0] or n, self.linear.group[1] or k

    def _scale_shape(self, experts: nn.Module, proj: str) -> tuple[int, ...]:
        if self.linear.group == (None, None):
            return (1,)
        (n, k), (gn, gk) = _nk(experts, proj), self._groups(experts, proj)
        return (-(-n // gn), -(-k // gk))

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        block_n, block_k = self.linear.group
        if block_n is not None and block_n > 1:  # block scales: gate/up's rows, down's columns
            _refuse_cut(layer, prefix, f"{self.name} block", block_n)
        if block_k is not None:
            _refuse_cut(layer, prefix, f"{self.name} block", block_k)
        scale_dims = (0 if block_n is not None else None, 1 if block_k is not None else None)
        split: dict[str, Optional[int]] = {}
        for proj in PROJECTIONS:
            column = proj == "gate_up_proj"
            split[stacked_name(proj, self.linear.scale_name)] = scale_dims[0 if column else 1]
            split[stacked_name(proj, "input_scale")] = None
            lead = _lead(layer, proj)
            replace_parameter(layer, proj, torch.empty((*lead, *_nk(layer, proj)), dtype=torch.float8_e4m3fn))
            scale = stacked_name(proj, self.linear.scale_name)
            replace_parameter(layer, scale, torch.empty((*lead, *self._scale_shape(layer, proj)), dtype=torch.float32))
            if self.linear.input_scale:  # static activation scales: read, not applied (W8A16)
                replace_parameter(layer, stacked_name(proj, "input_scale"), torch.empty((*lead, 1)))
        layer.checkpoint_split = split

    def process_after_loading(self, layer: nn.Module, prefix: str) -> None:
        grids = []
        for proj in PROJECTIONS:
            name = stacked_name(proj, self.linear.scale_name)
            scale = getattr(layer, name).data
            if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                raise QuantizationError(f"{prefix}.{name}: scales must be finite and positive")
            grids.append(scale if scale.dim() == len(_lead(layer, proj)) + 2 else scale.unsqueeze(-1))
        layer.quant_experts = QuantExperts(
            "fp8",
            layer.gate_up_proj.data,
            layer.down_proj.data,
            grids[0].contiguous(),
            grids[1].contiguous(),
            self._groups(layer, "gate_up_proj"),
            self._groups(layer, "down_proj"),
        )


class OnlineFp8MoeMethod(Fp8MoeMethod):
    """`model.quantization=fp8` on experts: the 16-bit experts load as usual, then become FP8 per output channel."""

    def __init__(self) -> None:
        super().__init__(OnlineFp8Method())

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        """Nothing: the 16-bit experts load (split like any 16-bit experts) until `process_after_loading`."""

    def process_after_loading(self, layer: nn.Module, prefix: str) -> None:
        for proj in PROJECTIONS:
            weight = getattr(layer, proj).data
            q, scale = quantize_fp8_per_channel(weight.reshape(-1, weight.shape[-1]))
            replace_parameter(layer, proj, q.view(weight.shape))
            replace_parameter(layer, stacked_name(proj, "weight_scale"), scale.view(*weight.shape[:-1], 1))
        super().process_after_loading(layer, prefix)


def _int4_words(layout: str, t: dict[str, torch.Tensor], zero_offset: int) -> tuple[torch.Tensor, ...]:
    """Batched checkpoint tensors [B, ...] -> (q uint8 [B, N, K], scales [B, N, K/G], zeros [B, N, K/G])."""
    if layout == "gptq":
        q = unpack_int4(t["qweight"], 1).transpose(1, 2)
        zeros = unpack_int4(t["qzeros"], 2).transpose(1, 2).float() + zero_offset
        return q, t["scales"].transpose(1, 2).float(), zeros
    if layout == "awq":
        q = unpack_int4(t["qweight"], 2, AWQ_ORDER).transpose(1, 2)
        zeros = unpack_int4(t["qzeros"], 2, AWQ_ORDER).transpose(1, 2).float()
        return q, t["scales"].transpose(1, 2).float(), zeros
    scales = t["weight_scale"].float()
    return unpack_int4(t["weight_packed"], 2), scales, torch.full_like(scales, 8.0)


class Int4MoeMethod(MoeQuantMethod):
    """4-bit experts in the linear method's layout (GPTQ, AWQ GEMM, compressed-tensors pack-quantized)."""

    def __init__(self, linear: Int4Method) -> None:
        self.name = f"{linear.name}-moe"  # type: ignore[misc]
        self.linear = linear

    def _group(self, experts: nn.Module, proj: str) -> int:
        return _nk(experts, proj)[1] if self.linear.group_size == -1 else self.linear.group_size

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        if self.linear.group_size != -1:
            _refuse_cut(layer, prefix, f"{self.name} group size", self.linear.group_size)
        split: dict[str, Optional[int]] = {}
        for proj in PROJECTIONS:
            (n, k), g = _nk(layer, proj), self._group(layer, proj)
            if n % 8 or k % 8 or k % g or g % 16:
                raise QuantizationError(
                    f"{prefix}.{proj}: {self.name} needs both dimensions a multiple of 8 and a group size that is a "
                    f"multiple of 16 dividing the input dimension (N={n}, K={k}, group {g}{_per_rank(layer)})"
                )
            del layer._parameters[proj]
            column = proj == "gate_up_proj"
            dims = split_dims(self.linear.layout, column, group_split=self.linear.group_size != -1)
            split.update({stacked_name(proj, name): dim for name, dim in dims.items()})
            for name, (shape, dtype) in int4_tensor_shapes(self.linear.layout, n, k, g).items():
                stacked = torch.empty((*_lead(layer, proj), *shape), dtype=dtype)
                replace_parameter(layer, stacked_name(proj, name), stacked)
        layer.checkpoint_split = split

    def _convert(self, layer: nn.Module, proj: str, prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        (n, k), g, lead = _nk(layer, proj), self._group(layer, proj), _lead(layer, proj)
        tp, rank = _parallel(layer)
        column = proj == "gate_up_proj"
        names = int4_tensor_shapes(self.linear.layout, n, k, g)
        params = layer._parameters
        tensors = {name: params.pop(stacked_name(proj, name)).data.flatten(0, len(lead) - 1) for name in names}
        if "g_idx" in tensors:  # global groups of this rank's input columns (down: K split) must be in order
            first, whole_k = (0, k) if column else (rank * k, k * tp)
            group = whole_k if self.linear.group_size == -1 else g
            in_order = (torch.arange(k, device=tensors["g_idx"].device) + first) // group
            if not bool((tensors["g_idx"] == in_order).all()):
                raise QuantizationError(
                    f"{prefix}.{proj}: GPTQ act-order (g_idx not k // group_size) on experts is not supported"
                )
        if "weight_shape" in tensors:
            full = [n * tp, k] if column else [n, k * tp]
            if not bool((tensors["weight_shape"] == torch.tensor(full, device=tensors["weight_shape"].device)).all()):
                raise QuantizationError(f"{prefix}.{proj}_weight_shape: expected {full} for every expert")
        q, scales, zeros = _int4_words(self.linear.layout, tensors, self.linear.zero_offset)
        words = pack_rows(q.reshape(-1, k).contiguous()).view(*lead, n, k // 8)
        return words, scales.reshape(*lead, n, k // g).contiguous(), zeros.reshape(*lead, n, k // g).contiguous()

    def process_after_loading(self, layer: nn.Module, prefix: str) -> None:
        (w1, s1, z1), (w2, s2, z2) = (self._convert(layer, proj, prefix) for proj in PROJECTIONS)
        for name, value in (("gate_up_proj", w1), ("down_proj", w2), ("gate_up_scale", s1), ("down_scale", s2)):
            replace_parameter(layer, name, value)
        replace_parameter(layer, "gate_up_zeros", z1)
        replace_parameter(layer, "down_zeros", z2)
        g1, g2 = self._group(layer, "gate_up_proj"), self._group(layer, "down_proj")
        layer.quant_experts = QuantExperts("int4", w1, w2, s1, s2, (1, g1), (1, g2), z1, z2)


class Mxfp4Method(QuantMethod):
    """The `mxfp4` format's choice for experts; MXFP4 exists for MoE experts only (`Mxfp4MoeMethod`)."""

    name = "mxfp4"

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        raise QuantizationError(f"{prefix}: mxfp4 quantizes MoE experts only, not linear layers")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise TypeError("mxfp4 has no linear layers")

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        raise TypeError("mxfp4 has no linear layers")


class Mxfp4MoeMethod(MoeQuantMethod):
    """MXFP4 experts: the checkpoint's uint8 blocks and E8M0 scales (module docstring), read by `QUANT` 3."""

    name = "mxfp4-moe"

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        """The blocks and scales of this rank's I (tensor parallelism: whole blocks of down's inputs only)."""
        tp, _ = _parallel(layer)
        if tp > 1:
            whole, key = _dims(layer)[1] * tp, getattr(layer, "intermediate_key", "moe_intermediate_size")
            if whole % MXFP4_GROUP == 0 and (whole // MXFP4_GROUP) % tp:
                raise QuantizationError(
                    f"{prefix}: parallel.tensor_parallel_size={tp} does not divide the mxfp4 experts' "
                    f"{whole // MXFP4_GROUP} blocks of {MXFP4_GROUP} intermediate features ({key} {whole}): "
                    "down_proj's blocks and scales cannot be split with its weights"
                )
        for proj in PROJECTIONS:
            (n, k), lead = _nk(layer, proj), _lead(layer, proj)
            if k % MXFP4_GROUP:
                raise QuantizationError(f"{prefix}.{proj}: mxfp4 needs the input dimension ({k}) a multiple of 32")
            del layer._parameters[proj]
            replace_parameter(layer, f"{proj}_blocks", torch.empty((*lead, n, k // 2), dtype=torch.uint8))
            replace_parameter(layer, f"{proj}_scales", torch.empty((*lead, n, k // MXFP4_GROUP), dtype=torch.uint8))
        # The intermediate dimension, as for the 16-bit tensors (gate/up's rows, down's packed inputs and scales).
        dims = {name: dim for name, dim in getattr(layer, "shard_dims", {}).items() if name not in PROJECTIONS}
        layer.shard_dims = {**dims, **{f"{proj}_{t}": 2 for proj in PROJECTIONS for t in ("blocks", "scales")}}

    def process_after_loading(self, layer: nn.Module, prefix: str) -> None:
        tensors = {}
        for proj in PROJECTIONS:
            scales = getattr(layer, f"{proj}_scales").data
            if bool((scales == 255).any()):
                raise QuantizationError(f"{prefix}.{proj}_scales: E8M0 exponent 255 (NaN) in the checkpoint")
            tensors[proj] = (getattr(layer, f"{proj}_blocks").data.contiguous(), scales.contiguous())
        (w1, s1), (w2, s2) = tensors["gate_up_proj"], tensors["down_proj"]
        group = (1, MXFP4_GROUP)
        layer.quant_experts = QuantExperts("mxfp4", w1, w2, s1, s2, group, group)

    def random_packed(self, tensor: str, noise: torch.Tensor, std: float) -> torch.Tensor:
        """Random-weight presets: bytes from the float32 `noise` (every e2m1 code about equally likely), and one
        exponent putting the weights' RMS near `std` (random e2m1 codes have an RMS of 2.9)."""
        if tensor.endswith("_scales"):
            exponent = 127 + round(math.log2(std / 2.9))
            return torch.full(noise.shape, exponent, dtype=torch.uint8, device=noise.device)
        return ((noise * 2**20).to(torch.int64) & 0xFF).to(torch.uint8)


def moe_method(linear: QuantMethod, prefix: str) -> MoeQuantMethod:
    """The experts' method for the method their linear layers get (`prefix` names the experts in errors)."""
    if isinstance(linear, Mxfp4Method):
        return Mxfp4MoeMethod()
    if isinstance(linear, OnlineFp8Method):
        return OnlineFp8MoeMethod()
    if isinstance(linear, Fp8LinearMethod):
        return Fp8MoeMethod(linear)
    if isinstance(linear, Int4Method):
        return Int4MoeMethod(linear)
    raise QuantizationError(f"{prefix}: {linear.name} has no quantized-experts layout")
