"""The fused MoE kernels over FP8 and INT4 expert weights against their PyTorch reference (interpreter on the CPU).

Layouts: FP8 with block scales (partial blocks in both dimensions), per-channel and per-tensor scales; 4-bit ints
with group scales and zero points up to 16 (GPTQ stores zero - 1), and per-channel ones ending in a partial K chunk
and a partial column tile. The reference itself is checked against a plain
dequantize-then-`fused_moe_reference` run, and a control shows a wrong input group (a scale or zero taken from the
neighbouring group) moves the output far outside the tolerance used here.
"""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels.fused_moe import MoeLaunchConfig, fused_moe_reference
from framework.layers.kernels.fused_moe_quant import (
    QuantExperts,
    dequantize_experts,
    fused_moe_quant,
    fused_moe_quant_reference,
    fused_moe_quant_triton,
)

SMALL = MoeLaunchConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)
E, TOP_K, M = 4, 2, 5


def _grid(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=g) * 0.02 + 0.005


def fp8_experts(h: int, i: int, groups: tuple[tuple[int, int], tuple[int, int]], seed: int = 0) -> QuantExperts:
    """Random e4m3 experts with random positive scales on the given (gn, gk) grids of gate/up and down."""
    g = torch.Generator().manual_seed(seed)
    (gn1, gk1), (gn2, gk2) = groups
    gate_up = (torch.randn(E, 2, i, h, generator=g) * 8).to(torch.float8_e4m3fn)
    down = (torch.randn(E, h, i, generator=g) * 8).to(torch.float8_e4m3fn)
    s1 = _grid(g, E, 2, -(-i // gn1), -(-h // gk1))
    s2 = _grid(g, E, -(-h // gn2), -(-i // gk2))
    return QuantExperts("fp8", gate_up, down, s1, s2, (gn1, gk1), (gn2, gk2))


def int4_experts(h: int, i: int, group: int, seed: int = 0, down_group: int = 0) -> QuantExperts:
    """Random 4-bit experts (any bit pattern), scales, and integer zero points 0..16; input groups `group` (gate/up)
    and `down_group` (default the same)."""
    g = torch.Generator().manual_seed(seed)
    g2 = down_group or group
    words = lambda *s: torch.randint(-(2**31), 2**31, s, generator=g, dtype=torch.int64).to(torch.int32)  # noqa: E731
    zeros = lambda *s: torch.randint(0, 17, s, generator=g).float()  # noqa: E731
    return QuantExperts(
        "int4",
        words(E, 2, i, h // 8),
        words(E, h, i // 8),
        _grid(g, E, 2, i, h // group) * 0.3,
        _grid(g, E, h, i // g2) * 0.3,
        (1, group),
        (1, g2),
        zeros(E, 2, i, h // group),
        zeros(E, h, i // g2),
    )


def _routing(h: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, h, generator=g).to(dtype)
    weights, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(TOP_K, dim=-1)
    return x, weights, ids


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: summation order only; 16-bit: a flipped last-bit rounding of an intermediate at most."""
    tol = 1e-5 if ref.dtype == torch.float32 else 2**-5
    scale = ref.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


CASES = {
    "fp8-block-partial": lambda: fp8_experts(64, 48, ((32, 32), (32, 32))),
    "fp8-block-wide-k": lambda: fp8_experts(64, 64, ((16, 64), (32, 64))),
    "fp8-channel": lambda: fp8_experts(64, 48, ((1, 64), (1, 48))),
    "fp8-tensor": lambda: fp8_experts(64, 48, ((48, 64), (64, 48))),
    "int4-g32": lambda: int4_experts(64, 64, 32),
    "int4-g16": lambda: int4_experts(64, 48, 16),
    # per-channel groups: I = 40 ends the down product's K in a partial chunk (one word of four) and the gate/up
    # product's columns in a partial tile
    "int4-channel-partial": lambda: int4_experts(64, 40, 64, down_group=40),
}


KERNEL_CASES = [(c, torch.bfloat16) for c in sorted(CASES)] + [
    ("fp8-block-partial", torch.float32),
    ("int4-g16", torch.float32),
    ("int4-channel-partial", torch.float32),
]


@pytest.mark.parametrize("case,dtype", KERNEL_CASES)
def test_kernel_matches_reference(case: str, dtype: torch.dtype) -> None:
    experts = CASES[case]()
    x, weights, ids = _routing(experts.shape[2], dtype)
    ref = fused_moe_quant_reference(x, experts, weights, ids)
    _assert_close(fused_moe_quant_triton(x, experts, weights, ids, config=SMALL), ref)


def test_default_tiles_and_dispatch() -> None:
    experts = CASES["int4-g32"]()
    x, weights, ids = _routing(64, torch.float32)
    ref = fused_moe_quant_reference(x, experts, weights, ids)
    _assert_close(fused_moe_quant_triton(x, experts, weights, ids), ref)
    _assert_close(fused_moe_quant(x, experts, weights, ids, backend="triton"), ref)
    torch.testing.assert_close(fused_moe_quant(x, experts, weights, ids, backend="reference"), ref)


@pytest.mark.parametrize("case", ["fp8-block-partial", "int4-g16"])
def test_reference_is_dequantize_then_moe(case: str) -> None:
    """In float32 the reference equals the unquantized MoE on the dequantized weights."""
    experts = CASES[case]()
    x, weights, ids = _routing(experts.shape[2], torch.float32)
    gate_up, down = dequantize_experts(experts)
    expected = fused_moe_reference(x, gate_up, down, weights, ids)
    torch.testing.assert_close(fused_moe_quant_reference(x, experts, weights, ids), expected, rtol=1e-5, atol=1e-5)


def _shift_k_groups(t: torch.Tensor) -> torch.Tensor:
    return t.roll(1, dims=-1)


@pytest.mark.parametrize("case", ["fp8-block-partial", "int4-g16"])
def test_wrong_input_group_is_detected(case: str) -> None:
    """Control: the scales (and zeros) of the neighbouring input group give an output far outside the tolerance."""
    import dataclasses

    experts = CASES[case]()
    x, weights, ids = _routing(experts.shape[2], torch.bfloat16)
    ref = fused_moe_quant_reference(x, experts, weights, ids)
    shifted = dataclasses.replace(experts, gate_up_scale=_shift_k_groups(experts.gate_up_scale))
    if experts.kind == "int4":
        assert experts.gate_up_zeros is not None
        shifted = dataclasses.replace(experts, gate_up_zeros=_shift_k_groups(experts.gate_up_zeros))
    with pytest.raises(AssertionError):
        _assert_close(fused_moe_quant_reference(x, shifted, weights, ids), ref)
