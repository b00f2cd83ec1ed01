"""The fused MoE kernels with gpt-oss's epilogue (per-expert biases, the clamped SwiGLU) and MXFP4 weights, against
their PyTorch references (interpreter on the CPU); the references against HF transformers' own code.

- `fused_moe_reference` with the epilogue equals transformers' `GptOssExperts` on the same (interleaved) weights,
  biases and routing, once de-interleaved by the model's `deinterleave_gate_up`;
- `dequantize_mxfp4` equals transformers' `convert_moe_packed_tensors` (the gpt-oss loader's dequantization) on
  the same blocks and scales, element for element;
- the kernels (float32 and bfloat16, partial tiles in both dimensions) match those references.
Planted faults, each must leave the tolerance: the clamp dropped (a limit no value reaches), the down bias
dropped, the MXFP4 nibbles of each byte swapped.
"""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels.fused_moe import MoeLaunchConfig, fused_moe_reference, fused_moe_triton
from framework.layers.kernels.fused_moe_quant import QuantExperts, fused_moe_quant_reference, fused_moe_quant_triton
from framework.layers.kernels.moe_epilogue import CLAMPED_SWIGLU, MoeEpilogue, dequantize_mxfp4
from framework.models.gpt_oss import deinterleave_gate_up

SMALL = MoeLaunchConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)
WIDE_K = MoeLaunchConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
E, TOP_K, M = 4, 2, 6
ALPHA, LIMIT = 1.702, 1.5  # a low limit: many gate and up values are clamped


def _routing(h: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, h, generator=g).to(dtype)
    weights, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(TOP_K, dim=-1)
    return x, weights.to(dtype), ids


def _dense(h: int, i: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(gate_up [E, 2, I, H], down [E, H, I], gate_up_bias [E, 2, I], down_bias [E, H])."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2, i, h, generator=g) * 0.3
    down = torch.randn(E, h, i, generator=g) * 0.2
    return tuple(
        t.to(dtype) for t in (gate_up, down, torch.randn(E, 2, i, generator=g), torch.randn(E, h, generator=g))
    )


def _epilogue(gate_up_bias: torch.Tensor, down_bias: torch.Tensor | None, limit: float = LIMIT) -> MoeEpilogue:
    return MoeEpilogue(CLAMPED_SWIGLU, ALPHA, limit, gate_up_bias, down_bias)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: summation order only; bfloat16: a flipped last-bit rounding of an intermediate at most."""
    tol = 1e-5 if ref.dtype == torch.float32 else 2**-5
    scale = ref.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


def _mxfp4(h: int, i: int, seed: int = 0) -> QuantExperts:
    """Random MXFP4 experts: any byte, exponents 2^-9 .. 2^-3."""
    g = torch.Generator().manual_seed(seed)
    blocks = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
    scales = lambda *s: torch.randint(118, 125, s, generator=g, dtype=torch.uint8)  # noqa: E731
    return QuantExperts(
        "mxfp4", blocks(E, 2, i, h // 2), blocks(E, h, i // 2), scales(E, 2, i, h // 32), scales(E, h, i // 32),
        (1, 32), (1, 32),
    )  # fmt: skip


def test_reference_matches_transformers_gpt_oss_experts() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    h, i = 32, 24
    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=E, swiglu_limit=LIMIT)
    hf = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    x, weights, ids = _routing(h, torch.float32)
    expected = hf(x, router_indices=ids, routing_weights=weights)
    gate_up = deinterleave_gate_up(hf.gate_up_proj.detach()).contiguous()
    bias = hf.gate_up_proj_bias.detach().view(E, i, 2).transpose(1, 2).contiguous()
    down = hf.down_proj.detach().transpose(1, 2).contiguous()
    epilogue = MoeEpilogue(CLAMPED_SWIGLU, cfg.swiglu_alpha, LIMIT, bias, hf.down_proj_bias.detach())
    got = fused_moe_reference(x, gate_up, down, weights, ids, epilogue)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    clamped = (x @ hf.gate_up_proj.detach()[ids[0, 0]]).abs() > LIMIT
    assert bool(clamped.any()), "the clamp should be reached"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_epilogue_kernel_matches_reference(dtype: torch.dtype) -> None:
    gate_up, down, gate_up_bias, down_bias = _dense(48, 40, dtype)  # partial K and N tiles
    x, weights, ids = _routing(48, dtype)
    epilogue = _epilogue(gate_up_bias, down_bias)
    ref = fused_moe_reference(x, gate_up, down, weights, ids, epilogue)
    _assert_close(fused_moe_triton(x, gate_up, down, weights, ids, config=SMALL, epilogue=epilogue), ref)


def test_mxfp4_dequantize_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)  # [E, N, K / 32, 16]
    scales = torch.randint(110, 140, (3, 8, 2), generator=g, dtype=torch.uint8)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    got = dequantize_mxfp4(blocks.reshape(3, 8, 32), scales)  # [E, N, K]
    assert torch.equal(got.transpose(1, 2), expected)


@pytest.mark.parametrize(
    "dtype, config", [(torch.float32, SMALL), (torch.bfloat16, WIDE_K)], ids=["float32-k32", "bfloat16-k64"]
)
def test_mxfp4_kernel_matches_reference(dtype: torch.dtype, config: MoeLaunchConfig) -> None:
    experts = _mxfp4(96, 64)  # K = 96: a 64-wide chunk spans two scale groups and ends in a partial chunk
    _, _, gate_up_bias, down_bias = _dense(96, 64, dtype, seed=2)
    x, weights, ids = _routing(96, dtype)
    epilogue = _epilogue(gate_up_bias, down_bias)
    ref = fused_moe_quant_reference(x, experts, weights, ids, epilogue)
    _assert_close(fused_moe_quant_triton(x, experts, weights, ids, config=config, epilogue=epilogue), ref)


def test_planted_faults_leave_the_tolerance() -> None:
    gate_up, down, gate_up_bias, down_bias = _dense(48, 40, torch.float32)
    x, weights, ids = _routing(48, torch.float32)
    ref = fused_moe_reference(x, gate_up, down, weights, ids, _epilogue(gate_up_bias, down_bias))
    for planted in (_epilogue(gate_up_bias, down_bias, limit=1e9), _epilogue(gate_up_bias, None)):
        with pytest.raises(AssertionError):
            _assert_close(fused_moe_triton(x, gate_up, down, weights, ids, config=SMALL, epilogue=planted), ref)
    experts = _mxfp4(64, 32)
    swapped = experts.gate_up.bitwise_left_shift(4) | experts.gate_up.bitwise_right_shift(4)
    x, weights, ids = _routing(64, torch.float32)
    epilogue = _epilogue(gate_up_bias[:, :, :32].contiguous(), None)
    ref = fused_moe_quant_reference(x, experts, weights, ids, epilogue)
    planted_experts = QuantExperts(**{**experts.__dict__, "gate_up": swapped})
    with pytest.raises(AssertionError):
        _assert_close(fused_moe_quant_triton(x, planted_experts, weights, ids, config=SMALL, epilogue=epilogue), ref)


def test_bad_bias_shape_is_named() -> None:
    gate_up, down, gate_up_bias, down_bias = _dense(32, 16, torch.float32)
    x, weights, ids = _routing(32, torch.float32)
    with pytest.raises(ValueError, match=r"down_bias must be a contiguous \[4, 32\]"):
        fused_moe_reference(x, gate_up, down, weights, ids, _epilogue(gate_up_bias, down_bias[:, :16]))


@pytest.mark.parametrize("m", [3, 64, 160])  # 1.5, 32 and 80 rows per expert: the three default launch configs
def test_default_launch_configs(m: int) -> None:
    """MXFP4 experts with the gpt-oss epilogue under `moe_launch_config`'s tiles (what the sm_90 compile check
    compiles for the GPU), bfloat16."""
    experts = _mxfp4(64, 64, seed=m)
    _, _, gate_up_bias, down_bias = _dense(64, 64, torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 64, generator=g).bfloat16()
    weights, ids = torch.softmax(torch.randn(m, E, generator=g), -1).topk(TOP_K, dim=-1)
    epilogue = _epilogue(gate_up_bias, down_bias)
    ref = fused_moe_quant_reference(x, experts, weights, ids, epilogue)
    _assert_close(fused_moe_quant_triton(x, experts, weights, ids, epilogue=epilogue), ref)
