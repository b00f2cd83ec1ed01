"""The fused MoE over FP8 experts with FP8 activations (W8A8) against its reference, under the interpreter.

Cases: block scales with the intermediate quantized inside the gate/up kernel (a tile of I is one activation
group, the last one partial) and outside it (per token, or a group narrower than the tile), per-channel and
per-tensor weight scales, float32 and bfloat16, gpt-oss's biased clamped SwiGLU. Each is compared with its
reference (quantize-dequantize the activations, float32 products) and with the W8A16 reference (16-bit
activations): within the FP8 activations' error, and told apart from it. `Fp8MoeMethod` switches to W8A8 from
`w8a8_min_tokens` on with the checkpoint's activation scheme (static input scales stay W8A16). Controls: the
neighbouring group's activation scales, or an intermediate left unquantized, leave the tolerance.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch

from framework.layers.kernels.fused_moe import MoeLaunchConfig
from framework.layers.kernels.fused_moe_quant import QuantExperts, fused_moe_quant_reference
from framework.layers.kernels.moe_epilogue import CLAMPED_SWIGLU, SILU_EPILOGUE, MoeEpilogue
from framework.layers.quantization.triton_moe_w8a8 import (
    fp8_fake_quant,
    fused_moe_w8a8_reference,
    fused_moe_w8a8_triton,
)
from framework.layers.quantization.triton_w8a8 import quantize_fp8_groups_reference
from framework.layers.quantization.triton_w8a16 import dequantize_fp8

E, M, TOP_K = 4, 6, 2


def fp8_experts(h: int, i: int, groups: tuple[tuple[int, int], tuple[int, int]]) -> QuantExperts:
    """Random e4m3 experts with random positive scales on the (group_n, group_k) grids of gate/up and down."""
    g = torch.Generator().manual_seed(0)
    (gn1, gk1), (gn2, gk2) = groups
    gate_up = (torch.randn(E, 2, i, h, generator=g) * 8).to(torch.float8_e4m3fn)
    down = (torch.randn(E, h, i, generator=g) * 8).to(torch.float8_e4m3fn)
    s1 = torch.rand(E, 2, -(-i // gn1), -(-h // gk1), generator=g) * 0.02 + 0.005
    s2 = torch.rand(E, -(-h // gn2), -(-i // gk2), generator=g) * 0.02 + 0.005
    return QuantExperts("fp8", gate_up, down, s1, s2, (gn1, gk1), (gn2, gk2))


def _routing(h: int, dtype: torch.dtype, m: int = M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, h, generator=g).to(dtype)
    x[1] = 0  # an all-zero token (scale 1)
    weights, ids = torch.softmax(torch.randn(m, E, generator=g), -1).topk(TOP_K, dim=-1)
    return x, weights, ids


def _rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: summation order only; bfloat16: a flipped last-bit rounding of an intermediate at most."""
    tol = 1e-5 if ref.dtype == torch.float32 else 2**-5
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * _rms(ref))


def _assert_fp8_activation_error(w8a8: torch.Tensor, w8a16: torch.Tensor) -> None:
    """FP8 activations: e4m3 rounds each of x and act by up to 2^-4 of itself, so the output's RMS moves by a few
    percent of its own (3-4 % on these cases), and by more than 16-bit rounding would."""
    err = _rms(w8a8.float() - w8a16.float()) / _rms(w8a16)
    assert 2**-8 < err < 2**-4, f"W8A8 differs from W8A16 by {err:.4f} of the output's RMS"


def _gpt_oss_epilogue(experts: QuantExperts) -> MoeEpilogue:
    e, i, h = experts.shape
    g = torch.Generator().manual_seed(9)
    bias = lambda *s: (torch.randn(*s, generator=g) * 0.3).bfloat16()  # noqa: E731
    return MoeEpilogue(CLAMPED_SWIGLU, 1.702, 7.0, bias(e, 2, i), bias(e, h))


# name: (experts, activation group, tiles, dtype, epilogue?)
CASES: dict[str, tuple[Callable[[], QuantExperts], Optional[int], tuple[int, int], torch.dtype, bool]] = {
    "block-fused-partial": (lambda: fp8_experts(80, 48, ((32, 32), (32, 32))), 32, (32, 32), torch.bfloat16, False),
    "block-unfused-f32": (lambda: fp8_experts(64, 48, ((32, 32), (32, 32))), 32, (64, 32), torch.float32, False),
    "channel-per-token": (lambda: fp8_experts(64, 48, ((1, 64), (1, 48))), None, (16, 32), torch.bfloat16, False),
    "tensor-one-tile": (lambda: fp8_experts(64, 48, ((48, 64), (64, 48))), None, (64, 32), torch.bfloat16, False),
    "block-gpt-oss": (lambda: fp8_experts(64, 64, ((32, 32), (32, 32))), 32, (32, 32), torch.bfloat16, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference_and_stays_near_w8a16(case: str) -> None:
    make, group, (block_n, block_k), dtype, gpt_oss = CASES[case]
    experts = make()
    epilogue = _gpt_oss_epilogue(experts) if gpt_oss else SILU_EPILOGUE
    x, weights, ids = _routing(experts.shape[2], dtype)
    config = MoeLaunchConfig(block_m=16, block_n=block_n, block_k=block_k, num_warps=4, num_stages=2)
    out = fused_moe_w8a8_triton(x, experts, weights, ids, group, config=config, epilogue=epilogue)
    ref = fused_moe_w8a8_reference(x, experts, weights, ids, group, epilogue)
    _assert_close(out, ref)
    _assert_fp8_activation_error(out, fused_moe_quant_reference(x, experts, weights, ids, epilogue))


def _neighbour_scales(rows: torch.Tensor) -> torch.Tensor:
    q, s = quantize_fp8_groups_reference(rows, 32)
    return dequantize_fp8(q, s.roll(1, dims=1), 1, 32)


@pytest.mark.parametrize("fault", ["neighbouring-group-scales", "intermediate-not-quantized"])
def test_planted_activation_faults_are_caught(fault: str) -> None:
    """Control: the tolerance of the kernel test catches a kernel reading another K group's activation scales, and
    one that runs the down GEMM on the 16-bit intermediate."""
    experts = CASES["block-fused-partial"][0]()
    x, weights, ids = _routing(experts.shape[2], torch.bfloat16)
    ref = fused_moe_w8a8_reference(x, experts, weights, ids, 32)
    if fault == "neighbouring-group-scales":
        wrong = fused_moe_quant_reference(x, experts, weights, ids, fake_quant=_neighbour_scales)
    else:
        only_x = lambda t: fp8_fake_quant(t, 32) if t.shape[-1] == experts.shape[2] else t.float()  # noqa: E731
        wrong = fused_moe_quant_reference(x, experts, weights, ids, fake_quant=only_x)
    with pytest.raises(AssertionError):
        _assert_close(wrong, ref)


class _Experts(torch.nn.Module):
    """What `apply_experts` reads of a loaded experts module."""

    def __init__(self, quant_experts: QuantExperts) -> None:
        super().__init__()
        self.quant_experts = quant_experts


def _moe_method(config: dict[str, Any]) -> Any:
    from framework.layers.quantization.config import quant_scheme
    from framework.layers.quantization.moe import moe_method

    linear = quant_scheme({"quantization_config": config}).method_for("model.layers.0.mlp.experts.0.gate_proj")
    return moe_method(linear, "model.layers.0.mlp.experts")  # type: ignore[arg-type]


CT_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


def _ct(strategy: str, inputs: dict[str, Any]) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": {**CT_WEIGHTS, "strategy": strategy}, "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": group}}


# name: (quantization_config, experts' weight groups, the activation group W8A8 uses, or "w8a16")
METHODS: dict[str, tuple[dict[str, Any], tuple[tuple[int, int], tuple[int, int]], Any]] = {
    "fp8-block": ({"quant_method": "fp8", "weight_block_size": [32, 32]}, ((32, 32), (32, 32)), 32),
    "ct-channel": (_ct("channel", {"num_bits": 8, "type": "float", "dynamic": True, "strategy": "token"}),
                   ((1, 64), (1, 48)), None),
    "ct-tensor-static": (_ct("tensor", {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"}),
                         ((48, 64), (64, 48)), "w8a16"),
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(METHODS))
def test_method_switches_to_w8a8_from_its_token_threshold(fmt: str) -> None:
    """From `w8a8_min_tokens` tokens on, FP8 experts quantize their activations as the checkpoint declares (block
    FP8: per token and block-width group, 32 here; FP8_DYNAMIC: per token) and run W8A8; below, W8A16. Static input
    scales: W8A16 at every size."""
    from framework.layers.quantization.moe import MOE_W8A8_MIN_TOKENS

    config, groups, group = METHODS[fmt]
    method = _moe_method(config)
    assert method.w8a8_min_tokens == MOE_W8A8_MIN_TOKENS
    method.w8a8_min_tokens = M  # the interpreter runs tiny batches
    experts = fp8_experts(64, 48, groups)
    x, weights, ids = _routing(64, torch.bfloat16)
    big = method.apply_experts(_Experts(experts), x, weights, ids, "triton")
    if group == "w8a16":
        expected = fused_moe_quant_reference(x, experts, weights, ids)
    else:
        expected = fused_moe_w8a8_reference(x, experts, weights, ids, group)
        small = method.apply_experts(_Experts(experts), x[:-1], weights[:-1], ids[:-1], "triton")
        _assert_close(small, fused_moe_quant_reference(x[:-1], experts, weights[:-1], ids[:-1]))
    _assert_close(big, expected)


def test_groups_narrower_than_an_fp8_product_are_refused_by_the_kernels() -> None:
    """FP8 tl.dot takes K chunks of 32 inputs or more: 16-wide groups stay W8A16 (the method asks first)."""
    from framework.layers.quantization.triton_moe_w8a8 import moe_w8a8_fits

    narrow = fp8_experts(64, 48, ((16, 16), (16, 16)))
    assert not moe_w8a8_fits(narrow, 16) and not moe_w8a8_fits(narrow, None)
    assert moe_w8a8_fits(fp8_experts(64, 48, ((32, 32), (32, 32))), 32)
    x, weights, ids = _routing(64, torch.bfloat16)
    with pytest.raises(ValueError, match="FP8 products need 32"):
        fused_moe_w8a8_triton(x, narrow, weights, ids, 16)
