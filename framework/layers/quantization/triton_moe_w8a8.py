"""The fused MoE MLP over FP8 experts with FP8 activations (W8A8): both grouped GEMMs FP8 x FP8 on the tensor cores.

For large batches (prefill; `Fp8MoeMethod.w8a8_min_tokens`) the activations are quantized as the checkpoint
declares them (`group`: per token and `group` inputs, block FP8; None: per token, FP8_DYNAMIC and online FP8),
and each expert GEMM multiplies e4m3 activations by e4m3 weights with float32 accumulation, twice the bf16 rate
on Hopper. The steps of `fused_moe_w8a8_triton`:

1. `quantize_fp8_groups` (`triton_w8a8.py`): `x [M, H]` -> e4m3 `[M, H]`, float32 scales `[M, H / gx]`;
2. `route_moe_rows` (`fused_moe.py`, shared with the 16-bit kernels) groups the `M * K` (token, choice) rows by
   expert in blocks of `BLOCK_M` (`moe_align`);
3. `_moe_w8a8_gate_up_kernel`: per (row block, tile of I) the gate and up products over H, each `BLOCK_K` chunk's
   FP8 x FP8 partial sums multiplied by the row's activation scale and the tile's weight scale; the epilogue
   (`moe_tiles._gate_up_epilogue`: biases, SiLU-and-mul, rounded to the model dtype) gives `act`, which is
   quantized again for the down GEMM. When a tile of I is exactly one activation group (`BLOCK_N` = 128 = the
   block FP8 group) the kernel quantizes its tile itself and writes e4m3 `act [M * K, I]` and its scales
   `[M * K, I / gx]`; otherwise (per token over I) it writes `act` in the model dtype and `quantize_fp8_groups`
   quantizes it;
4. `_moe_down_kernel`'s twin `_moe_w8a8_down_kernel`: `act @ down[e]^T` the same way, times the routing weight;
5. the K choices of each token are summed in float32.

Semantics (`fused_moe_w8a8_reference`): `fused_moe_quant_reference` with every product's input rows, x and act,
replaced by their quantize-dequantize (`quantize_fp8_groups_reference`): the quantized activations times the
dequantized weights, float32 accumulation, the 16-bit MoE's rounding of gate, up, act and the output.

The e4m3 values of `act` are rounded in float32 arithmetic (`_round_to_e4m3`): nearest, ties to even, as PyTorch
and the GPU's conversion round; Triton's interpreter converts float32 -> e4m3 wrongly (0.49 -> 0.25), an exact
value it converts right. Under the interpreter (numpy has no FP8 product) the tiles go to `tl.dot` as float32.
FP8 products take K chunks of 32 inputs or more: experts whose activation or weight groups along K are narrower
are refused (`moe_w8a8_fits`; the method keeps W8A16 for them).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.fused_moe import MoeLaunchConfig, MoeRows, moe_tile_args, route_moe_rows
from framework.layers.kernels.fused_moe_quant import QuantExperts, check_quant_moe_input, fused_moe_quant_reference
from framework.layers.kernels.launch_math import cdiv
from framework.layers.kernels.moe_epilogue import SILU_EPILOGUE, MoeEpilogue
from framework.layers.kernels.moe_tiles import _expert_weight_tile, _gate_up_epilogue, _moe_row_block, _store_down
from framework.layers.quantization.base import FP8_DTYPE
from framework.layers.quantization.triton_w8a8 import quantize_fp8_groups, quantize_fp8_groups_reference, w8a8_block_k
from framework.layers.quantization.triton_w8a16 import dequantize_fp8

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
FP8_DOT_MIN_K = 32  # Triton's FP8 tl.dot on sm_90 takes K >= 32


# Tiles of both kernels. Triton issues Hopper's FP8 MMA (wgmma, e4m3 x e4m3) for blocks of 64 rows or more; 16- and
# 32-row blocks take mma.sync with the FP8 tiles widened to fp16 (the bf16 rate). 128-wide tiles of I are one block
# FP8 activation group (the gate/up kernel quantizes its own tile) and 128-input chunks one FP8 weight block. With
# 4 warps or 128-row blocks, the gate/up kernel's two float32 accumulators spill (ptxas -v for sm_90a; 8 warps and
# 64 rows: 178 registers, no spill). `bench_fp8_moe.py` times them on the GPU.
MOE_W8A8_TILES = MoeLaunchConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)


@triton.jit
def _round_to_e4m3(v):
    """float32 `v` (|v| <= 448) -> float32 holding the nearest e4m3 value, ties to even: v in units of its e4m3
    step (2^(exponent - 3), exponent >= -6: subnormals below), rounded by adding and subtracting 1.5 * 2^23."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    inv_step = ((130 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(3 - exponent), exact
    step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)
    return ((v * inv_step + 12582912.0) - 12582912.0) * step


@triton.jit
def _w8a8_chunk(
    acc,  # [BLOCK_M, BLOCK_N] float32
    a,  # [BLOCK_M, BLOCK_K] e4m3 activations
    sa,  # [BLOCK_M] float32 activation scales of the chunk's group
    w,  # [BLOCK_K, BLOCK_N] e4m3 weights (`_expert_weight_tile`)
    sw_ptr,  # the expert matrix's [SCALE_ROWS, SCALE_COLS] float32 weight scales at `scale_base`
    scale_base,
    rows,  # [BLOCK_N] output rows of the tile
    row_mask,
    k0,  # first input of the chunk (inside one activation and one weight group)
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """acc + (a @ w) * sa * sw: one FP8 x FP8 product (float32 accumulation), scaled per row and column."""
    sw = tl.load(sw_ptr + scale_base + (rows // GROUP_N) * SCALE_COLS + k0 // GROUP_K, mask=row_mask, other=0.0)
    if UPCAST:
        partial = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        partial = tl.dot(a, w)
    return acc + partial * sa[:, None] * sw[None, :]


@triton.jit(do_not_specialize=["num_rows"])
def _moe_w8a8_gate_up_kernel(
    xq_ptr,  # [M, H] float8_e4m3fn activations, contiguous
    sx_ptr,  # [M, cdiv(H, GROUP_X)] float32 activation scales, contiguous
    w_ptr,  # [E, 2, I, H] float8_e4m3fn gate/up weights, contiguous
    sw_ptr,  # [E, 2, SCALE_ROWS, SCALE_COLS] float32 weight scales
    b_ptr,  # HAS_BIAS: [E, 2, I] gate/up biases (else unused)
    out_ptr,  # [M * K, I] out, by (token, choice) row: FUSE_QUANT: e4m3 act; else act in DTYPE
    so_ptr,  # FUSE_QUANT: [M * K, cdiv(I, BLOCK_N)] float32 out: act's scales, one group per tile (else unused)
    sorted_rows_ptr,  # [P] int32 rows grouped by expert (moe_align); num_rows marks padding
    block_expert_ptr,  # [P // BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    num_rows,  # M * K
    H: tl.constexpr,
    I: tl.constexpr,
    TOP_K: tl.constexpr,
    GROUP_X: tl.constexpr,  # activation group along H (H: per token)
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    DTYPE: tl.constexpr,  # the model dtype: act is rounded to it before it is quantized
    FUSE_QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # inside one activation group and one weight group
    UPCAST: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a block past the padded total (the grid is sized for the worst case)
    rows, valid, tokens, expert, cols, col_mask = _moe_row_block(
        sorted_rows_ptr, block_expert_ptr, num_rows, pid_m, pid_n, I, TOP_K, BLOCK_M, BLOCK_N
    )
    gate_base = expert * (2 * I * H)
    gate_scales = expert * (2 * SCALE_ROWS * SCALE_COLS)
    up_scales = gate_scales + SCALE_ROWS * SCALE_COLS
    sx_rows = sx_ptr + tokens * ((H + GROUP_X - 1) // GROUP_X)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        a = tl.load(xq_ptr + tokens[:, None] * H + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        sa = tl.load(sx_rows + k0 // GROUP_X, mask=valid, other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = _expert_weight_tile(w_ptr, gate_base, cols, ks, H, w_mask, 1)
        w_up = _expert_weight_tile(w_ptr, gate_base + I * H, cols, ks, H, w_mask, 1)
        acc_gate = _w8a8_chunk(
            acc_gate, a, sa, w_gate, sw_ptr, gate_scales, cols, col_mask, k0, GROUP_N, GROUP_K, SCALE_COLS, UPCAST
        )
        acc_up = _w8a8_chunk(
            acc_up, a, sa, w_up, sw_ptr, up_scales, cols, col_mask, k0, GROUP_N, GROUP_K, SCALE_COLS, UPCAST
        )
    act = _gate_up_epilogue(
        acc_gate, acc_up, b_ptr, expert, cols, col_mask, I, DTYPE, ACTIVATION, HAS_BIAS, ALPHA, LIMIT
    )
    out_rows = rows.to(tl.int64)
    out_mask = valid[:, None] & col_mask[None, :]
    if FUSE_QUANT:  # the tile is one activation group: quantize_fp8_groups' arithmetic on the rounded act
        act = tl.where(out_mask, act, 0.0)
        amax = tl.max(tl.abs(act), axis=1)
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        q = _round_to_e4m3(tl.minimum(tl.maximum(act / scale[:, None], -448.0), 448.0))
        tl.store(out_ptr + out_rows[:, None] * I + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(so_ptr + out_rows * ((I + BLOCK_N - 1) // BLOCK_N) + pid_n, scale, mask=valid)
    else:
        tl.store(out_ptr + out_rows[:, None] * I + cols[None, :], act.to(DTYPE), mask=out_mask)


@triton.jit(do_not_specialize=["num_rows"])
def _moe_w8a8_down_kernel(
    aq_ptr,  # [M * K, I] float8_e4m3fn act, contiguous
    sa_ptr,  # [M * K, cdiv(I, GROUP_A)] float32 act scales, contiguous
    w_ptr,  # [E, H, I] float8_e4m3fn down weights, contiguous
    sw_ptr,  # [E, SCALE_ROWS, SCALE_COLS] float32 weight scales
    b_ptr,  # HAS_BIAS: [E, H] down biases (else unused)
    topk_weights_ptr,  # [M * K] routing weight of each row (any float dtype)
    out_ptr,  # [M * K, H] out: weight * down(act) in the model dtype, contiguous
    sorted_rows_ptr,  # [P] int32
    block_expert_ptr,  # [P // BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    num_rows,  # M * K
    H: tl.constexpr,
    I: tl.constexpr,
    GROUP_A: tl.constexpr,  # activation group along I
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    _, valid, safe_rows, expert, cols, col_mask = _moe_row_block(
        sorted_rows_ptr, block_expert_ptr, num_rows, pid_m, pid_n, H, 1, BLOCK_M, BLOCK_N
    )
    base = expert * (H * I)
    scales = expert * (SCALE_ROWS * SCALE_COLS)
    sa_rows = sa_ptr + safe_rows * ((I + GROUP_A - 1) // GROUP_A)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < I
        a = tl.load(aq_ptr + safe_rows[:, None] * I + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        sa = tl.load(sa_rows + k0 // GROUP_A, mask=valid, other=0.0)
        w = _expert_weight_tile(w_ptr, base, cols, ks, I, k_mask[:, None] & col_mask[None, :], 1)
        acc = _w8a8_chunk(acc, a, sa, w, sw_ptr, scales, cols, col_mask, k0, GROUP_N, GROUP_K, SCALE_COLS, UPCAST)
    _store_down(acc, topk_weights_ptr, b_ptr, out_ptr, safe_rows, valid, expert, cols, col_mask, H, HAS_BIAS)


def fp8_fake_quant(rows: torch.Tensor, group: Optional[int]) -> torch.Tensor:
    """[N, K] -> float32 [N, K]: the rows quantized to e4m3 per token and `group` inputs (None: the whole row) and
    dequantized, as the W8A8 kernels see them."""
    k = rows.shape[-1]
    gx = min(group or k, k)
    q, s = quantize_fp8_groups_reference(rows, gx)
    return dequantize_fp8(q, s, 1, gx)


def fused_moe_w8a8_reference(
    x: torch.Tensor,  # [M, H]
    experts: QuantExperts,  # kind "fp8"
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K] expert ids
    group: Optional[int],  # activation group (block FP8: 128); None: per token
    epilogue: MoeEpilogue = SILU_EPILOGUE,
) -> torch.Tensor:
    """[M, H]: the MoE MLP with FP8 activations (module docstring)."""
    return fused_moe_quant_reference(x, experts, topk_weights, topk_ids, epilogue, lambda t: fp8_fake_quant(t, group))


class _W8a8Plan(NamedTuple):
    """Per-launch constants: each GEMM's activation group and K chunk, and whether the gate/up kernel quantizes."""

    group_x: int  # along H
    group_a: int  # along I
    block_k_gate_up: int
    block_k_down: int
    fuse_quant: bool


def _chunks(experts: QuantExperts, group: Optional[int], block_k: int) -> tuple[int, int]:
    """The K chunks (<= `block_k`) of the gate/up and the down GEMM: inside one activation and one weight group."""
    _, i, h = experts.shape
    gate_up = w8a8_block_k(h, min(group or h, h), experts.gate_up_groups[1])
    return min(block_k, gate_up), min(block_k, w8a8_block_k(i, min(group or i, i), experts.down_groups[1]))


def moe_w8a8_fits(experts: QuantExperts, group: Optional[int]) -> bool:
    """Whether the W8A8 kernels take these experts: FP8, with K chunks of at least `FP8_DOT_MIN_K` inputs (every
    activation and weight group along K a multiple of 32, or the whole input)."""
    try:
        return experts.kind == "fp8" and min(_chunks(experts, group, 128)) >= FP8_DOT_MIN_K
    except ValueError:  # a group that is not a multiple of 16
        return False


def _plan(experts: QuantExperts, group: Optional[int], cfg: MoeLaunchConfig) -> _W8a8Plan:
    _, i, h = experts.shape
    group_x, group_a = min(group or h, h), min(group or i, i)
    block_k_gate_up, block_k_down = _chunks(experts, group, cfg.block_k)
    if min(block_k_gate_up, block_k_down) < FP8_DOT_MIN_K:
        raise ValueError(
            f"fused_moe_w8a8: K chunks of {block_k_gate_up} / {block_k_down} inputs (activation group {group}, weight "
            f"groups {experts.gate_up_groups} / {experts.down_groups}, BLOCK_K {cfg.block_k}): FP8 products need 32"
        )
    fuse = cfg.block_n == group_a or (cfg.block_n >= i and group_a >= i)  # each tile of I is one group
    return _W8a8Plan(group_x, group_a, block_k_gate_up, block_k_down, fuse)


def _launch_gate_up(
    xq: torch.Tensor,  # [M, H] e4m3
    sx: torch.Tensor,  # [M, cdiv(H, group_x)] float32
    experts: QuantExperts,
    routing: MoeRows,
    dtype: torch.dtype,  # the model dtype
    cfg: MoeLaunchConfig,
    plan: _W8a8Plan,
    epilogue: MoeEpilogue,
    upcast: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 act [M * K, I], float32 scales [M * K, cdiv(I, group_a)]) of every (token, choice) row."""
    e, i, h = experts.shape
    act = routing.empty(i, FP8_DTYPE if plan.fuse_quant else dtype)
    act_scales = routing.empty(cdiv(i, plan.group_a) if plan.fuse_quant else 0, torch.float32)
    gate_up_bias, _, act_consts = epilogue.kernel_args(sx)
    (gn, gk), grid = experts.gate_up_groups, experts.gate_up_scale.shape[-2:]
    _moe_w8a8_gate_up_kernel[routing.grid(i, cfg)](
        xq, sx, experts.gate_up, experts.gate_up_scale, gate_up_bias, act, act_scales, *routing.args,
        H=h, I=i, TOP_K=routing.k, GROUP_X=plan.group_x, GROUP_N=gn, GROUP_K=min(gk, h), SCALE_ROWS=grid[0],
        SCALE_COLS=grid[1], DTYPE=TL_DTYPES[dtype], FUSE_QUANT=plan.fuse_quant, BLOCK_K=plan.block_k_gate_up,
        UPCAST=upcast, **act_consts, **moe_tile_args(cfg),
    )  # fmt: skip
    if plan.fuse_quant:
        return act, act_scales
    return quantize_fp8_groups(act, plan.group_a, use_kernel=act.is_cuda)


def fused_moe_w8a8_triton(
    x: torch.Tensor,  # [M, H] bf16/fp16/fp32, last dim contiguous
    experts: QuantExperts,  # kind "fp8", contiguous tensors on x's device
    topk_weights: torch.Tensor,  # [M, K] routing weights
    topk_ids: torch.Tensor,  # [M, K] int32/int64 expert ids in [0, E)
    group: Optional[int],  # activation group along each GEMM's input (block FP8: 128); None: per token
    config: MoeLaunchConfig = MOE_W8A8_TILES,  # BLOCK_K is narrowed to lie inside the groups
    epilogue: MoeEpilogue = SILU_EPILOGUE,  # biases and activation (moe_epilogue.py)
) -> torch.Tensor:
    """[M, H] the MoE MLP with FP8 x FP8 expert GEMMs (module docstring; semantics `fused_moe_w8a8_reference`)."""
    if experts.kind != "fp8":
        raise ValueError(f"fused_moe_w8a8: experts must be FP8, got {experts.kind}")
    check_quant_moe_input("fused_moe_w8a8", x, experts, epilogue)
    e, i, h = experts.shape
    m, k = topk_ids.shape
    if m * k == 0:
        return x.new_zeros(m, h)
    plan = _plan(experts, group, config)
    upcast = os.environ.get("TRITON_INTERPRET") == "1"  # numpy has no FP8 product
    xq, sx = quantize_fp8_groups(x, plan.group_x, use_kernel=x.is_cuda)
    routing = route_moe_rows(x, topk_weights, topk_ids, e, config)
    aq, sa = _launch_gate_up(xq, sx, experts, routing, x.dtype, config, plan, epilogue, upcast)
    per_choice = routing.empty(h, x.dtype)
    (gn, gk), grid = experts.down_groups, experts.down_scale.shape[-2:]
    down_bias = x if epilogue.down_bias is None else epilogue.down_bias
    _moe_w8a8_down_kernel[routing.grid(h, config)](
        aq, sa, experts.down, experts.down_scale, down_bias, routing.weights, per_choice, *routing.args,
        H=h, I=i, GROUP_A=plan.group_a, GROUP_N=gn, GROUP_K=min(gk, i), SCALE_ROWS=grid[0], SCALE_COLS=grid[1],
        BLOCK_K=plan.block_k_down, UPCAST=upcast, HAS_BIAS=epilogue.down_bias is not None, **moe_tile_args(config),
    )  # fmt: skip
    return routing.combine(per_choice)
