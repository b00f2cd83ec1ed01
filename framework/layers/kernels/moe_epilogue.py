"""What an MoE layer adds around the experts' two GEMMs: per-expert biases and the activation (`MoeEpilogue`).

For the rows of expert e (PyTorch reference `expert_mlp_reference`, each step rounded to the activation dtype as
HF's per-expert loops round it):

    gate, up = x @ gate[e]^T (+ gate_up_bias[e, 0]),  x @ up[e]^T (+ gate_up_bias[e, 1])
    act      = silu(gate) * up                                            SILU_AND_MUL (Qwen, Mixtral, ...)
             = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)    CLAMPED_SWIGLU (gpt-oss), g = min(gate, limit)
             = gelu_tanh(gate) * up                                       GELU_TANH_AND_MUL (Gemma 4)
    y        = act @ down[e]^T (+ down_bias[e])

gpt-oss's checkpoints interleave gate and up column by column (`gate_up_proj [E, H, 2I]`, gate = [..., ::2]); the
model de-interleaves them once at load into the kernels' `[E, 2, I, H]` (biases `[E, 2, I]`), so the kernels read
gate and up tiles as for every other MoE. The kernels take the epilogue as constexprs (`ACTIVATION`, `HAS_BIAS`,
`ALPHA`, `LIMIT`): a layer without biases compiles the same code as before they existed.

Also here: `dequantize_mxfp4`, the reference of the kernels' MXFP4 weight tiles.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch.nn import functional as F

SILU_AND_MUL, CLAMPED_SWIGLU, GELU_TANH_AND_MUL = 0, 1, 2
# FP4 e2m1 codes 0..15 (bit 3: sign, bits 1-2: exponent with bias 1, bit 0: mantissa), as the OCP MX spec has them.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # inputs per E8M0 scale
E8M0_BIAS = 127


class MoeEpilogue(NamedTuple):
    """The activation (`SILU_AND_MUL`, `CLAMPED_SWIGLU` with `alpha`, `limit`, or `GELU_TANH_AND_MUL`) and optional
    per-expert biases."""

    activation: int = SILU_AND_MUL
    alpha: float = 1.0
    limit: float = 0.0
    gate_up_bias: Optional[torch.Tensor] = None  # [E, 2, I] (gate = [:, 0]), contiguous
    down_bias: Optional[torch.Tensor] = None  # [E, H], contiguous

    def check(self, e: int, i: int, h: int) -> None:
        """Raise `ValueError` naming a bias whose shape does not fit E experts of intermediate I, hidden H."""
        if self.activation not in (SILU_AND_MUL, CLAMPED_SWIGLU, GELU_TANH_AND_MUL):
            raise ValueError(
                f"fused_moe: activation {self.activation} is not SILU_AND_MUL (0), CLAMPED_SWIGLU (1) or "
                "GELU_TANH_AND_MUL (2)"
            )
        biases = (("gate_up_bias", self.gate_up_bias, (e, 2, i)), ("down_bias", self.down_bias, (e, h)))
        for name, bias, shape in biases:
            if bias is not None and (tuple(bias.shape) != shape or not bias.is_contiguous()):
                raise ValueError(f"fused_moe: {name} must be a contiguous {list(shape)}, got {tuple(bias.shape)}")

    def kernel_args(self, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, object]]:
        """(gate/up bias pointer, down bias pointer, gate/up kernel constexprs); `dummy` stands in for no bias."""
        consts: dict[str, object] = dict(
            ACTIVATION=self.activation,
            HAS_BIAS=self.gate_up_bias is not None,
            ALPHA=float(self.alpha) if self.activation == CLAMPED_SWIGLU else 0.0,
            LIMIT=float(self.limit) if self.activation == CLAMPED_SWIGLU else 0.0,
        )
        gate_up = dummy if self.gate_up_bias is None else self.gate_up_bias
        return gate_up, dummy if self.down_bias is None else self.down_bias, consts


SILU_EPILOGUE = MoeEpilogue()
GELU_TANH_EPILOGUE = MoeEpilogue(GELU_TANH_AND_MUL)


def activation_reference(gate: torch.Tensor, up: torch.Tensor, epilogue: MoeEpilogue) -> torch.Tensor:
    """[N, I] act from the rounded gate and up products (their dtype), as HF computes it."""
    if epilogue.activation == SILU_AND_MUL:
        return F.silu(gate) * up
    if epilogue.activation == GELU_TANH_AND_MUL:
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=epilogue.limit)
    up = up.clamp(min=-epilogue.limit, max=epilogue.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * epilogue.alpha))


def expert_mlp_reference(
    x: torch.Tensor,  # [N, H] the rows routed to `expert`, activation dtype
    gate: torch.Tensor,  # [I, H] this expert's weights; float32 for quantized experts (products rounded once)
    up: torch.Tensor,  # [I, H]
    down: torch.Tensor,  # [H, I]
    expert: int,
    epilogue: MoeEpilogue,
    fake_quant: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,  # W8A8: rows -> quantized, dequantized
) -> torch.Tensor:
    """[N, H] in x's dtype: one expert's MLP (module docstring), products in the weights' dtype. `fake_quant`
    (FP8 activations) replaces each product's input rows, x and the activation, by their quantized values."""
    dtype = x.dtype
    h = x.to(gate.dtype) if fake_quant is None else fake_quant(x)
    g, u = F.linear(h, gate).to(dtype), F.linear(h, up).to(dtype)
    if epilogue.gate_up_bias is not None:
        g = g + epilogue.gate_up_bias[expert, 0].to(dtype)
        u = u + epilogue.gate_up_bias[expert, 1].to(dtype)
    act = activation_reference(g, u, epilogue).to(dtype)
    y = F.linear(act.to(down.dtype) if fake_quant is None else fake_quant(act), down).to(dtype)
    if epilogue.down_bias is not None:
        y = y + epilogue.down_bias[expert].to(dtype)
    return y


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., N, K / 2] (input 2c in the low nibble of byte c, 2c + 1 in the high one) and E8M0 scales
    [..., N, K / 32] -> float32 [..., N, K]: e2m1(code) * 2^(scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"dequantize_mxfp4: blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    k = blocks.shape[-1] * 2
    if tuple(scales.shape) != (*blocks.shape[:-1], k // MXFP4_GROUP) or k % MXFP4_GROUP:
        raise ValueError(f"dequantize_mxfp4: scales {tuple(scales.shape)} do not fit blocks {tuple(blocks.shape)}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()  # [..., N, K]
    exponents = (scales.int() - E8M0_BIAS).repeat_interleave(MXFP4_GROUP, dim=-1)
    return torch.ldexp(table[codes], exponents.float())
