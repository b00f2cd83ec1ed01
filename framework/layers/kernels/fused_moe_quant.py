"""The fused MoE MLP over quantized expert weights: FP8 e4m3 with group scales, 4-bit ints with zero points, MXFP4.

The weights stay quantized in memory and are dequantized inside the fused MoE kernels (`fused_moe.py`'s
`_moe_gate_up_kernel` / `_moe_down_kernel` with `QUANT` 1, 2 or 3), one `BLOCK_K` chunk at a time. FP8 and INT4:
every chunk lies inside one input group, so its values (e4m3, or `q - zero`) widen exactly to the activation dtype,
one tensor-core product accumulates in float32 and the output rows' group scales multiply the partial sums. MXFP4
(gpt-oss): each e2m1 value times its group's power of two is exact in bfloat16 / float32, so the tile is
dequantized in registers before the product and a chunk may span groups. Layouts (`QuantExperts`):

    kind   gate_up                       down                      scales (per projection)
    fp8    [E, 2, I, H] float8_e4m3fn    [E, H, I] float8_e4m3fn   float32 [E, (2,) ceil(N / gn), ceil(K / gk)]
    int4   [E, 2, I, H / 8] int32        [E, H, I / 8] int32       float32 scales and zeros [E, (2,) N, K / G]
    mxfp4  [E, 2, I, H / 2] uint8        [E, H, I / 2] uint8       uint8 E8M0 exponents [E, (2,) N, K / 32]

(N, K: the projection's output and input sizes; int4 words hold inputs 8c + j in bits 4j..4j+3; an int4 weight is
`scale * (q - zero)`; an MXFP4 byte holds inputs 2c (low nibble) and 2c + 1, a weight is `e2m1 * 2^(scale - 127)`,
`moe_epilogue.dequantize_mxfp4`.) FP8 block checkpoints have gn = gk = 128, per-channel ones gn = 1, gk = K,
per-tensor ones gn = N, gk = K. Semantics (`fused_moe_quant_reference`): `fused_moe_reference` with the dequantized
float32 weights, each projection's product accumulated in float32 and rounded once to the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from framework.layers.kernels.backend import triton_enabled
from framework.layers.kernels.fused_moe import (
    TRITON_DTYPES,
    MoeLaunchConfig,
    ProjectionQuant,
    combine_experts_reference,
    launch_moe_kernels,
    moe_launch_config,
    warm_moe_launches,
)
from framework.layers.kernels.moe_epilogue import SILU_EPILOGUE, MoeEpilogue, dequantize_mxfp4, expert_mlp_reference
from framework.layers.kernels.moe_launch import MoeShape, moe_shape

QUANT_CODES = {"fp8": 1, "int4": 2, "mxfp4": 3}


@dataclass(frozen=True)
class QuantExperts:
    """One layer's quantized experts (module docstring). `groups`: (gn, gk) of the gate/up and of the down
    projection (int4: (1, G) for both; mxfp4: (1, 32))."""

    kind: str  # "fp8", "int4" or "mxfp4"
    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor
    gate_up_groups: tuple[int, int]
    down_groups: tuple[int, int]
    gate_up_zeros: Optional[torch.Tensor] = None  # int4 only
    down_zeros: Optional[torch.Tensor] = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(experts E, intermediate I, hidden H)."""
        e, _, i = self.gate_up.shape[:3]
        return e, i, self.down.shape[1]

    def projections(self) -> tuple[ProjectionQuant, ProjectionQuant]:
        """(gate/up, down) as the kernels read them."""
        code = QUANT_CODES[self.kind]
        return (
            ProjectionQuant(code, self.gate_up_scale, self.gate_up_zeros, *self.gate_up_groups),
            ProjectionQuant(code, self.down_scale, self.down_zeros, *self.down_groups),
        )


def unpack_int4_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., K / 8] -> float32 [..., K]: input 8c + j from bits 4j..4j+3 of word c."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).float().flatten(-2)


def _expand(grid: torch.Tensor, n: int, k: int, gn: int, gk: int) -> torch.Tensor:
    """[..., SN, SK] group values -> [..., N, K]: each weight element's."""
    return grid.repeat_interleave(gn, -2)[..., :n, :].repeat_interleave(gk, -1)[..., :k]


def dequantize_projection(
    kind: str, weight: torch.Tensor, scale: torch.Tensor, zeros: Optional[torch.Tensor], groups: tuple[int, int]
) -> torch.Tensor:
    """One stacked projection as float32 [E, (2,) N, K]."""
    if kind == "fp8":
        n, k = weight.shape[-2:]
        return weight.float() * _expand(scale.float(), n, k, *groups)
    if kind == "mxfp4":
        return dequantize_mxfp4(weight, scale)
    q = unpack_int4_words(weight)
    n, k = q.shape[-2:]
    assert zeros is not None
    return _expand(scale.float(), n, k, *groups) * (q - _expand(zeros.float(), n, k, *groups))


def dequantize_experts(experts: QuantExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up float32 [E, 2, I, H], down float32 [E, H, I]): the weights the checkpoint means."""
    gate_up = dequantize_projection(
        experts.kind, experts.gate_up, experts.gate_up_scale, experts.gate_up_zeros, experts.gate_up_groups
    )
    down = dequantize_projection(
        experts.kind, experts.down, experts.down_scale, experts.down_zeros, experts.down_groups
    )
    return gate_up, down


def fused_moe_quant_reference(
    x: torch.Tensor,  # [M, H]
    experts: QuantExperts,
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K] expert ids
    epilogue: MoeEpilogue = SILU_EPILOGUE,  # biases and activation (moe_epilogue.py)
    fake_quant: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,  # FP8 activations (expert_mlp_reference)
) -> torch.Tensor:
    """[M, H]: `fused_moe_reference`'s semantics over the dequantized weights (float32 products, rounded once);
    with `fake_quant`, over the quantized activations too (`triton_moe_w8a8`'s reference)."""
    gate_up, down = dequantize_experts(experts)
    epilogue.check(*experts.shape)

    def mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        w_gate, w_up = gate_up[expert, 0], gate_up[expert, 1]
        return expert_mlp_reference(rows, w_gate, w_up, down[expert], expert, epilogue, fake_quant)

    return combine_experts_reference(x, topk_weights, topk_ids, gate_up.shape[0], mlp)


def quant_block_k(block_k: int, experts: QuantExperts) -> int:
    """The widest K chunk (<= `block_k`) inside one input group of both projections (MXFP4: any multiple of its
    32-input groups, the tile is dequantized before the product, a group's exponent loaded once)."""
    if experts.kind == "mxfp4":
        return max(block_k, 32)
    _, i, h = experts.shape
    for block in (128, 64, 32, 16):
        if block > block_k:
            continue
        fits = [gk % block == 0 or gk >= k for (_, gk), k in ((experts.gate_up_groups, h), (experts.down_groups, i))]
        if all(fits):
            return block
    raise ValueError(
        f"fused_moe_quant: input groups {experts.gate_up_groups[1]}, {experts.down_groups[1]} are not multiples of 16"
    )


def check_quant_moe_input(name: str, x: torch.Tensor, experts: QuantExperts, epilogue: MoeEpilogue) -> None:
    """Raise `ValueError` (prefixed `name`) unless the epilogue fits the experts and `x` is what the kernels take."""
    e, i, h = experts.shape
    epilogue.check(e, i, h)
    if x.dim() != 2 or x.shape[1] != h or x.dtype not in TRITON_DTYPES or x.stride(1) != 1:
        raise ValueError(f"{name}: x must be [tokens, {h}] float32/16 with a contiguous last dim")


def fused_moe_quant_triton(
    x: torch.Tensor,  # [M, H] bf16/fp16/fp32, last dim contiguous
    experts: QuantExperts,  # contiguous tensors on x's device
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K] int32/int64 in [0, E)
    config: Optional[MoeLaunchConfig] = None,  # default `moe_launch_config`; BLOCK_K narrowed into a group
    epilogue: MoeEpilogue = SILU_EPILOGUE,  # biases and activation (moe_epilogue.py)
) -> torch.Tensor:
    """[M, H] the MoE MLP output with the weights dequantized inside the kernels (`fused_moe_quant_reference`)."""
    check_quant_moe_input("fused_moe_quant", x, experts, epilogue)
    e, i, h = experts.shape
    m, k = topk_ids.shape
    if m * k == 0:
        return x.new_zeros(m, h)
    if config is None:
        shape = moe_shape(x.device, experts.kind, e, i, h, k)
        _warm(shape, x, experts, topk_weights, topk_ids, epilogue)  # once per process: every tile set compiles
        config = moe_launch_config(m * k, e, shape)
    cfg = _narrow(config, experts)
    gate_up_quant, down_quant = experts.projections()
    w1, w2 = experts.gate_up, experts.down
    return launch_moe_kernels(x, w1, w2, topk_weights, topk_ids, cfg, gate_up_quant, down_quant, epilogue)


def warm_fused_moe_quant(
    x: torch.Tensor,  # [M >= 1, H] a real launch's inputs, as `fused_moe_quant_triton` takes them
    experts: QuantExperts,
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K]
    epilogue: MoeEpilogue = SILU_EPILOGUE,
) -> int:
    """`warm_moe_launches` for these experts: every tile set their format's table (or the heuristic) can pick,
    narrowed as the launches narrow it, compiled once per process (FP8's W8A8 path calls it too, so that the W8A16
    kernels it falls back to below `MOE_W8A8_MIN_TOKENS` are compiled by a large warm-up batch)."""
    e, i, h = experts.shape
    return _warm(
        moe_shape(x.device, experts.kind, e, i, h, topk_ids.shape[1]), x, experts, topk_weights, topk_ids, epilogue
    )


def _warm(
    shape: Optional[MoeShape],
    x: torch.Tensor,
    experts: QuantExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    epilogue: MoeEpilogue,
) -> int:
    gate_up_quant, down_quant = experts.projections()
    return warm_moe_launches(
        shape, x, experts.gate_up, experts.down, topk_weights, topk_ids, gate_up_quant, down_quant, epilogue,
        lambda cfg: _narrow(cfg, experts),
    )  # fmt: skip


def _narrow(cfg: MoeLaunchConfig, experts: QuantExperts) -> MoeLaunchConfig:
    return cfg.narrow_block_k(lambda block_k: quant_block_k(block_k, experts))


def fused_moe_quant(
    x: torch.Tensor,  # [M, H]
    experts: QuantExperts,
    topk_weights: torch.Tensor,  # [M, K]
    topk_ids: torch.Tensor,  # [M, K]
    backend: str = "auto",  # kernels.backend
    epilogue: MoeEpilogue = SILU_EPILOGUE,  # biases and activation (moe_epilogue.py)
) -> torch.Tensor:
    """[M, H]: the kernels on CUDA (or when forced), the reference otherwise (as `fused_moe`)."""
    if x.dtype in TRITON_DTYPES and x.stride(-1) == 1 and triton_enabled(x.device, x, backend=backend):
        return fused_moe_quant_triton(x, experts, topk_weights, topk_ids, epilogue=epilogue)
    return fused_moe_quant_reference(x, experts, topk_weights, topk_ids, epilogue)
