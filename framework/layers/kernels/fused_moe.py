"""Fused Mixture-of-Experts MLP: tokens grouped by expert, one grouped GEMM for gate/up, one for down.

Semantics (`fused_moe_reference`): for token t and each of its top-k choices (expert e, weight w),

    y[t, j] = w * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t]))        rounded to x.dtype
    out[t]  = sum over j of y[t, j]                                          summed in float32, rounded once

with gate/up products and the SiLU-and-mul product rounded to x.dtype as HF's eager expert loop does. The rows of
the problem are the `M * K` (token, choice) pairs, `row = token * K + choice` (the flattened `topk_ids` index). A
layer may add per-expert biases and take gpt-oss's clamped SwiGLU instead of SiLU-and-mul (`MoeEpilogue`,
`moe_epilogue.py`).

The Triton path (`fused_moe_triton`):
1. `moe_align` (`framework/layers/kernels/moe_align.py`; CUDA-graph safe) sorts the rows by expert and pads each
   expert's run to a multiple of `BLOCK_M`, so that every block of `BLOCK_M` sorted rows belongs to one expert.
   Its buffers are sized for the worst case; blocks past the padded total exit at once.
2. `_moe_gate_up_kernel`: per (row block, intermediate tile) both the gate and the up accumulators over the
   hidden dimension (the activations gathered by token), biases and activation in the epilogue -> `act [M * K, I]`.
3. `_moe_down_kernel`: per (row block, hidden tile) `act @ down[e]^T`, scaled by the routing weight -> `[M * K, H]`.
4. The K choices of each token are summed (float32).

Expert weights are stacked per projection: `gate_up [E, 2, I, H]` (gate = [:, 0], up = [:, 1]) and
`down [E, H, I]`, so a tensor-parallel rank holding a slice of I keeps both halves aligned (see models/moe.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.backend import launch_compiles, triton_enabled
from framework.layers.kernels.launch_math import cdiv
from framework.layers.kernels.moe_align import moe_align
from framework.layers.kernels.moe_epilogue import SILU_EPILOGUE, MoeEpilogue, expert_mlp_reference
from framework.layers.kernels.moe_launch import (
    MoeLaunchConfig,
    MoeShape,
    dtype_name,
    launch_configs,
    moe_launch_config,
    moe_shape,
)
from framework.layers.kernels.moe_tiles import (
    _dot_expert_tile,
    _expert_weight_tile,
    _gate_up_epilogue,
    _int4_weight_tile,
    _moe_row_block,
    _mxfp4_weight_tile,
    _store_down,
)
from framework.layers.kernels.triton_norm_silu import interpreter_upcast

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# The row count changes every step: not specialised, so CUDA-graph capture at many sizes compiles one variant.
@triton.jit(do_not_specialize=["num_rows"])
def _moe_gate_up_kernel(
    x_ptr,  # [M, H] activations, row stride stride_xm, last dim contiguous
    w_ptr,  # [E, 2, I, H] stacked gate/up weights, contiguous (int4: [E, 2, I, H // 8] int32)
    s_ptr,  # QUANT: [E, 2, SCALE_ROWS, SCALE_COLS] float32 scales (else unused)
    z_ptr,  # QUANT == 2: zero points, the scales' layout (else unused)
    b_ptr,  # HAS_BIAS: [E, 2, I] gate/up biases (else unused)
    act_ptr,  # [M * K, I] out: the activation per (token, choice) row, contiguous
    sorted_rows_ptr,  # [P] int32 rows grouped by expert; num_rows marks padding
    block_expert_ptr,  # [P // BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    num_rows,  # M * K
    stride_xm,
    H: tl.constexpr,
    I: tl.constexpr,
    TOP_K: tl.constexpr,
    QUANT: tl.constexpr,  # see moe_tiles.py (3: MXFP4, scales [E, 2, I, H / 32] uint8)
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee": float32 inputs are not rounded to TF32
    UPCAST: tl.constexpr,  # interpreter only: bfloat16 tiles go to tl.dot as float32 (see interpreter_upcast)
    ACTIVATION: tl.constexpr,  # moe_epilogue.py: 0 SiLU-and-mul, 1 clamped SwiGLU
    HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a block past the padded total (the grid is sized for the worst case)
    dtype = act_ptr.dtype.element_ty
    rows, valid, tokens, expert, cols, col_mask = _moe_row_block(
        sorted_rows_ptr, block_expert_ptr, num_rows, pid_m, pid_n, I, TOP_K, BLOCK_M, BLOCK_N
    )
    matrix = I * H // 8 if QUANT == 2 else (I * H // 2 if QUANT == 3 else I * H)  # elements of one gate matrix
    gate_base = expert * (2 * matrix)
    gate_scales = expert * (2 * SCALE_ROWS * SCALE_COLS)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        up_scales = gate_scales + SCALE_ROWS * SCALE_COLS
        if QUANT == 3:
            w_gate = _mxfp4_weight_tile(w_ptr, s_ptr, gate_base, gate_scales, cols, col_mask, k0, H, BLOCK_K)
            w_up = _mxfp4_weight_tile(w_ptr, s_ptr, gate_base + matrix, up_scales, cols, col_mask, k0, H, BLOCK_K)
        elif QUANT == 2:
            w_gate = _int4_weight_tile(
                w_ptr, z_ptr, gate_base, gate_scales, cols, col_mask, k0, H, GROUP_K, SCALE_COLS, BLOCK_K
            )
            w_up = _int4_weight_tile(
                w_ptr, z_ptr, gate_base + matrix, up_scales, cols, col_mask, k0, H, GROUP_K, SCALE_COLS, BLOCK_K
            )
        else:
            w_gate = _expert_weight_tile(w_ptr, gate_base, cols, ks, H, w_mask, QUANT)
            w_up = _expert_weight_tile(w_ptr, gate_base + matrix, cols, ks, H, w_mask, QUANT)
        acc_gate = _dot_expert_tile(
            acc_gate, a, w_gate, s_ptr, gate_scales, cols, col_mask, k0,
            QUANT, GROUP_N, GROUP_K, SCALE_COLS, PRECISION, UPCAST,
        )  # fmt: skip
        acc_up = _dot_expert_tile(
            acc_up, a, w_up, s_ptr, up_scales, cols, col_mask, k0,
            QUANT, GROUP_N, GROUP_K, SCALE_COLS, PRECISION, UPCAST,
        )  # fmt: skip
    # Rounded as the reference: both projections (+ biases), then each step of the activation.
    act = _gate_up_epilogue(
        acc_gate, acc_up, b_ptr, expert, cols, col_mask, I, dtype, ACTIVATION, HAS_BIAS, ALPHA, LIMIT
    )
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=valid[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _moe_down_kernel(
    act_ptr,  # [M * K, I] contiguous
    w_ptr,  # [E, H, I] stacked down weights, contiguous (int4: [E, H, I // 8] int32)
    s_ptr,  # QUANT: [E, SCALE_ROWS, SCALE_COLS] float32 scales (else unused)
    z_ptr,  # QUANT == 2: zero points, the scales' layout (else unused)
    b_ptr,  # HAS_BIAS: [E, H] down biases (else unused)
    topk_weights_ptr,  # [M * K] routing weight of each row (any float dtype)
    out_ptr,  # [M * K, H] out: weight * down(act), contiguous
    sorted_rows_ptr,  # [P] int32
    block_expert_ptr,  # [P // BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    num_rows,  # M * K
    H: tl.constexpr,
    I: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
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
    base = expert * (H * I // 8 if QUANT == 2 else (H * I // 2 if QUANT == 3 else H * I))
    scales = expert * (SCALE_ROWS * SCALE_COLS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < I
        a = tl.load(act_ptr + safe_rows[:, None] * I + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        if QUANT == 3:
            w = _mxfp4_weight_tile(w_ptr, s_ptr, base, scales, cols, col_mask, k0, I, BLOCK_K)
        elif QUANT == 2:
            w = _int4_weight_tile(w_ptr, z_ptr, base, scales, cols, col_mask, k0, I, GROUP_K, SCALE_COLS, BLOCK_K)
        else:
            w = _expert_weight_tile(w_ptr, base, cols, ks, I, w_mask, QUANT)
        acc = _dot_expert_tile(
            acc, a, w, s_ptr, scales, cols, col_mask, k0,
            QUANT, GROUP_N, GROUP_K, SCALE_COLS, PRECISION, UPCAST,
        )  # fmt: skip
    _store_down(acc, topk_weights_ptr, b_ptr, out_ptr, safe_rows, valid, expert, cols, col_mask, H, HAS_BIAS)


def check_moe_inputs(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    """Raise `ValueError` naming the first argument whose shape or dtype does not fit the others."""
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be [tokens, hidden], got shape {tuple(x.shape)}")
    m, h = x.shape
    if gate_up.dim() != 4 or gate_up.shape[1] != 2 or gate_up.shape[3] != h:
        raise ValueError(
            f"fused_moe: gate_up must be [experts, 2, intermediate, hidden={h}], got {tuple(gate_up.shape)}"
        )
    e, _, i, _ = gate_up.shape
    if tuple(down.shape) != (e, h, i):
        raise ValueError(
            f"fused_moe: down must be [experts={e}, hidden={h}, intermediate={i}], got {tuple(down.shape)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_ids.shape[1] > e:
        raise ValueError(f"fused_moe: topk_ids must be [tokens={m}, k <= experts={e}], got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"fused_moe: topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"fused_moe: weights ({gate_up.dtype}, {down.dtype}) must have x's dtype {x.dtype}")


def fused_moe_reference(
    x: torch.Tensor,  # [M, H]
    gate_up: torch.Tensor,  # [E, 2, I, H]
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [M, K] routing weights (any float dtype; applied in float32)
    topk_ids: torch.Tensor,  # [M, K] int expert ids
    epilogue: MoeEpilogue = SILU_EPILOGUE,  # biases and activation (moe_epilogue.py)
) -> torch.Tensor:
    """[M, H] the MoE MLP output (module docstring), one expert at a time over the tokens routed to it."""
    check_moe_inputs(x, gate_up, down, topk_weights, topk_ids)
    epilogue.check(*gate_up.shape[:3:2], x.shape[1])

    def mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return expert_mlp_reference(rows, gate_up[expert, 0], gate_up[expert, 1], down[expert], expert, epilogue)

    return combine_experts_reference(x, topk_weights, topk_ids, gate_up.shape[0], mlp)


def combine_experts_reference(
    x: torch.Tensor,  # [M, H]
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K] expert ids
    num_experts: int,
    mlp: Callable[[int, torch.Tensor], torch.Tensor],  # (expert, its tokens' rows [T, H]) -> [T, H] in x.dtype
) -> torch.Tensor:
    """[M, H]: each expert's MLP over the tokens routed to it, times the routing weight (rounded to x.dtype), the K
    choices of a token summed in float32 and rounded once (the references of every fused MoE wrapper)."""
    m, k = topk_ids.shape
    per_choice = torch.zeros(m, k, x.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(num_experts):
        tokens, choices = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        y = mlp(expert, x[tokens])
        weight = topk_weights[tokens, choices].float().unsqueeze(1)
        per_choice[tokens, choices] = (y.float() * weight).to(x.dtype).float()
    return per_choice.sum(1).to(x.dtype)


def fused_moe_triton(
    x: torch.Tensor,  # [M, H] bf16/fp16/fp32, last dim contiguous
    gate_up: torch.Tensor,  # [E, 2, I, H] x.dtype, contiguous
    down: torch.Tensor,  # [E, H, I] x.dtype, contiguous
    topk_weights: torch.Tensor,  # [M, K] routing weights
    topk_ids: torch.Tensor,  # [M, K] int32/int64 expert ids in [0, E)
    config: MoeLaunchConfig | None = None,  # tiles; default `moe_launch_config` (the GPU's table or heuristic)
    epilogue: MoeEpilogue = SILU_EPILOGUE,  # biases and activation (moe_epilogue.py)
) -> torch.Tensor:
    """[M, H] the MoE MLP output computed by the two grouped-GEMM kernels (semantics: `fused_moe_reference`).
    Without `config`, a shape's first eager launch on a GPU compiles every tile set it may take later
    (`warm_moe_launches`)."""
    check_moe_inputs(x, gate_up, down, topk_weights, topk_ids)
    epilogue.check(*gate_up.shape[:3:2], x.shape[1])
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(f"fused_moe_triton: dtype {x.dtype} is not supported (float32, float16, bfloat16)")
    if x.stride(1) != 1 or not gate_up.is_contiguous() or not down.is_contiguous():
        raise ValueError("fused_moe_triton: x's last dim and the weights must be contiguous")
    m, h = x.shape
    e, _, i, _ = gate_up.shape
    k = topk_ids.shape[1]
    num_rows = m * k
    if num_rows == 0:
        return x.new_zeros(m, h)
    if config is not None:
        return launch_moe_kernels(x, gate_up, down, topk_weights, topk_ids, config, NO_QUANT, NO_QUANT, epilogue)
    shape = moe_shape(x.device, dtype_name(x.dtype), e, i, h, k)
    warm_moe_launches(shape, x, gate_up, down, topk_weights, topk_ids, NO_QUANT, NO_QUANT, epilogue)
    cfg = moe_launch_config(num_rows, e, shape)
    return launch_moe_kernels(x, gate_up, down, topk_weights, topk_ids, cfg, NO_QUANT, NO_QUANT, epilogue)


class ProjectionQuant(NamedTuple):
    """How one stacked projection's weights reach the kernels: `code` 0 (x's dtype), 1 (FP8 e4m3 with a float32
    scale per `group_n x group_k` tile: `scale [E, (2,) ceil(N / group_n), ceil(K / group_k)]`), 2 (int32 words of
    eight 4-bit values along K, `scale` and `zeros` `[E, (2,) N, K / group_k]`, group_n 1) or 3 (MXFP4: uint8
    `[E, (2,) N, K / 2]`, two e2m1 values a byte, uint8 E8M0 `scale [E, (2,) N, K / 32]`, groups (1, 32))."""

    code: int
    scale: Optional[torch.Tensor]
    zeros: Optional[torch.Tensor]
    group_n: int
    group_k: int


NO_QUANT = ProjectionQuant(0, None, None, 1, 1)


def _quant_args(weight: torch.Tensor, quant: ProjectionQuant) -> tuple[list[torch.Tensor], dict[str, int]]:
    """The kernel's (scale, zero-point) pointers and quantization constexprs for one projection."""
    scale = weight if quant.scale is None else quant.scale
    zeros = scale if quant.zeros is None else quant.zeros
    rows, cols = (1, 1) if quant.scale is None else quant.scale.shape[-2:]
    consts = dict(QUANT=quant.code, GROUP_N=quant.group_n, GROUP_K=quant.group_k, SCALE_ROWS=rows, SCALE_COLS=cols)
    return [scale, zeros], consts


class MoeRows(NamedTuple):
    """One launch's routing, shared by the fused MoE wrappers (16-bit and quantized weights here, FP8 activations
    in `triton_moe_w8a8.py`): the `M * K` (token, choice) rows grouped by expert in blocks of `BLOCK_M`."""

    m: int
    k: int
    h: int
    device: torch.device
    num_blocks: int  # the grid's rows (the worst case; blocks past the padded total exit)
    args: tuple  # (sorted_rows, block_expert, num_padded, num_rows): every kernel's routing arguments
    weights: torch.Tensor  # [M * K] routing weights (the down kernels widen them to float32, no extra launch)

    def grid(self, n: int, cfg: MoeLaunchConfig) -> tuple[int, int]:
        """(row blocks, tiles of `n` output columns)."""
        return self.num_blocks, cdiv(n, cfg.block_n)

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """[M * K, n] uninitialised, one row per (token, choice)."""
        return torch.empty(self.m * self.k, n, dtype=dtype, device=self.device)

    def combine(self, per_choice: torch.Tensor) -> torch.Tensor:
        """[M * K, H] -> [M, H]: the K choices of each token summed in float32, rounded once (as the reference)."""
        return per_choice.view(self.m, self.k, self.h).sum(1)


def route_moe_rows(
    x: torch.Tensor,  # [M, H]
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K] int32/int64 expert ids in [0, E)
    num_experts: int,
    cfg: MoeLaunchConfig,
) -> MoeRows:
    """`moe_align` of the rows in blocks of `cfg.block_m` and what the kernels take from it."""
    m, k = topk_ids.shape
    align = moe_align(topk_ids, num_experts, cfg.block_m)
    args = (align.sorted_rows, align.block_expert, align.num_padded, m * k)
    return MoeRows(m, k, x.shape[1], x.device, align.block_expert.shape[0], args, topk_weights.reshape(-1))


def moe_tile_args(cfg: MoeLaunchConfig) -> dict[str, int]:
    """The launch keywords every fused MoE kernel takes from the config (BLOCK_K is each wrapper's)."""
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def launch_moe_kernels(
    x: torch.Tensor,  # [M, H] bf16/fp16/fp32, last dim contiguous
    gate_up: torch.Tensor,  # [E, 2, I, H] (int4: [E, 2, I, H // 8] int32; mxfp4: [E, 2, I, H // 2] uint8), contiguous
    down: torch.Tensor,  # [E, H, I] (int4: [E, H, I // 8] int32; mxfp4: [E, H, I // 2] uint8), contiguous
    topk_weights: torch.Tensor,  # [M, K] routing weights
    topk_ids: torch.Tensor,  # [M, K] int32/int64 expert ids in [0, E)
    cfg: MoeLaunchConfig,  # gate/up's tiles and `cfg.down_config()` down's; BLOCK_K inside each quantized group
    gate_up_quant: ProjectionQuant,
    down_quant: ProjectionQuant,
    epilogue: MoeEpilogue = SILU_EPILOGUE,  # checked by the callers
) -> torch.Tensor:
    """[M, H] the MoE MLP output (inputs checked by the callers); the two grouped GEMMs of the module docstring."""
    if cfg.down_config().block_m != cfg.block_m:
        raise ValueError(f"fused_moe: gate/up and down tiles must share block_m, got {cfg}")
    routing = route_moe_rows(x, topk_weights, topk_ids, gate_up.shape[0], cfg)
    act = launch_moe_gate_up(x, gate_up, routing, cfg, gate_up_quant, epilogue)
    per_choice = launch_moe_down(act, down, routing, cfg.down_config(), down_quant, epilogue)
    return routing.combine(per_choice)


# What a process has warmed (`warm_moe_launches`): a shape on a device under one launch signature. A per-process
# record like Triton's own kernel cache, which it mirrors; never cleared.
_WARMED: set[tuple] = set()


def warm_moe_launches(
    shape: Optional[MoeShape],  # the launch's table key (`moe_shape`; None off CUDA: nothing is compiled there)
    x: torch.Tensor,  # [M, H] a real launch's inputs, as `launch_moe_kernels` takes them: their first token runs
    gate_up: torch.Tensor,  # [E, 2, I, H] (quantized: its packed layout)
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K]
    gate_up_quant: ProjectionQuant,
    down_quant: ProjectionQuant,
    epilogue: MoeEpilogue = SILU_EPILOGUE,
    narrow: Callable[[MoeLaunchConfig], MoeLaunchConfig] = lambda cfg: cfg,  # quantized: block_k into a group
    folder: Optional[Path] = None,  # the tables (default `moe_launch.CONFIG_DIR`)
) -> int:
    """Compile every tile set the launches of `shape` can take (`launch_configs`: each distinct table entry, else
    the heuristic's three) by launching the gate/up and the down kernel once per set (and `moe_align` once per
    `block_m`) on the first token of a real launch's inputs; returns the number of sets launched.

    A table picks tiles by token count, so a batch size the warm-up never ran would otherwise compile its variant
    inside a served step (seconds). The one-token launches specialise as every later launch does: the kernels mark
    the row counts `do_not_specialize`, and the only specialised integer, gate/up's `stride_xm`, is the real
    input's. Once per (device, shape, launch signature) per process; nothing on the CPU (the interpreter compiles
    nothing) or while a CUDA graph is captured (the next eager launch warms).
    """
    if shape is None:
        return 0
    key = (
        x.device,
        shape,
        _launch_signature(x, gate_up, down, topk_weights, topk_ids, gate_up_quant, down_quant, epilogue),
    )
    if key in _WARMED or not _may_compile(x.device):
        return 0
    x, topk_weights, topk_ids = x[:1], topk_weights[:1], topk_ids[:1]
    sets = list(dict.fromkeys(narrow(cfg) for cfg in launch_configs(shape, folder)))
    for cfg in sets:
        routing = route_moe_rows(x, topk_weights, topk_ids, gate_up.shape[0], cfg)
        act = launch_moe_gate_up(x, gate_up, routing, cfg, gate_up_quant, epilogue)
        launch_moe_down(act, down, routing, cfg.down_config(), down_quant, epilogue)
    _WARMED.add(key)
    return len(sets)


_may_compile = launch_compiles  # a module attribute: tests stand a CPU in for a GPU through it


def _launch_signature(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_quant: ProjectionQuant,
    down_quant: ProjectionQuant,
    epilogue: MoeEpilogue,
) -> tuple:
    """What besides the tiles selects a compiled variant: argument dtypes, constexprs, specialised integers."""
    stride = x.stride(0)
    quant = [
        (q.code, q.group_n, q.group_k, None if q.scale is None else (q.scale.dtype, *q.scale.shape[-2:]))
        for q in (gate_up_quant, down_quant)
    ]
    _, _, act_consts = epilogue.kernel_args(x)
    return (
        x.dtype, gate_up.dtype, down.dtype, topk_weights.dtype, topk_ids.dtype, stride == 1, stride % 16 == 0,
        *quant, *act_consts.values(), epilogue.down_bias is not None,
    )  # fmt: skip


def _tile_consts(cfg: MoeLaunchConfig, dtype: torch.dtype) -> dict:
    return dict(moe_tile_args(cfg), BLOCK_K=cfg.block_k, PRECISION="ieee", UPCAST=interpreter_upcast(dtype))


def launch_moe_gate_up(
    x: torch.Tensor,  # [M, H] bf16/fp16/fp32, last dim contiguous
    gate_up: torch.Tensor,  # [E, 2, I, H] as `launch_moe_kernels` takes it
    routing: MoeRows,  # `route_moe_rows` with cfg.block_m
    cfg: MoeLaunchConfig,  # gate/up's tiles (its `down` is not read)
    quant: ProjectionQuant,
    epilogue: MoeEpilogue = SILU_EPILOGUE,
) -> torch.Tensor:
    """[M * K, I] the activation of every (token, choice) row: the first grouped GEMM alone (the tuner times it)."""
    i = gate_up.shape[2]
    act = routing.empty(i, x.dtype)
    gate_up_bias, _, act_consts = epilogue.kernel_args(x)
    ptrs, consts = _quant_args(gate_up, quant)
    _moe_gate_up_kernel[routing.grid(i, cfg)](
        x, gate_up, *ptrs, gate_up_bias, act, *routing.args, x.stride(0), H=routing.h, I=i, TOP_K=routing.k,
        **consts, **_tile_consts(cfg, x.dtype), **act_consts,
    )  # fmt: skip
    return act


def launch_moe_down(
    act: torch.Tensor,  # [M * K, I] from `launch_moe_gate_up`
    down: torch.Tensor,  # [E, H, I] as `launch_moe_kernels` takes it
    routing: MoeRows,  # the same routing as gate/up's (so the same block_m)
    cfg: MoeLaunchConfig,  # down's tiles
    quant: ProjectionQuant,
    epilogue: MoeEpilogue = SILU_EPILOGUE,
) -> torch.Tensor:
    """[M * K, H] weight * down(act) per (token, choice) row: the second grouped GEMM alone."""
    h, i = routing.h, act.shape[1]
    per_choice = routing.empty(h, act.dtype)
    _, down_bias, _ = epilogue.kernel_args(act)
    ptrs, consts = _quant_args(down, quant)
    _moe_down_kernel[routing.grid(h, cfg)](
        act, down, *ptrs, down_bias, routing.weights, per_choice, *routing.args, H=h, I=i, **consts,
        **_tile_consts(cfg, act.dtype), HAS_BIAS=epilogue.down_bias is not None,
    )  # fmt: skip
    return per_choice


def fused_moe(
    x: torch.Tensor,  # [M, H]
    gate_up: torch.Tensor,  # [E, 2, I, H]
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K] expert ids
    backend: str = "auto",  # kernels.backend (framework/layers/kernels/backend.py)
    epilogue: MoeEpilogue = SILU_EPILOGUE,  # biases and activation (moe_epilogue.py)
) -> torch.Tensor:
    """[M, H] the MoE MLP output: the Triton kernels on CUDA (or when forced, as for the other layer ops), the
    reference otherwise and for anything autograd must see. See `fused_moe_reference` for the semantics."""
    kernel_takes = (
        x.dim() == 2
        and x.dtype in TRITON_DTYPES
        and x.stride(-1) == 1
        and gate_up.is_contiguous()
        and down.is_contiguous()
    )
    if kernel_takes and triton_enabled(x.device, x, gate_up, down, backend=backend):
        return fused_moe_triton(x, gate_up, down, topk_weights, topk_ids, epilogue=epilogue)
    return fused_moe_reference(x, gate_up, down, topk_weights, topk_ids, epilogue)
