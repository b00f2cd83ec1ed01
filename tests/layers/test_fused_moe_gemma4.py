"""The fused MoE kernels with Gemma 4's GELU-tanh epilogue (`GELU_TANH_EPILOGUE`) against their PyTorch reference
(interpreter on the CPU), and the reference against HF transformers' `Gemma4TextExperts` on the same weights and
routing (its `gate_up_proj [E, 2I, H]` viewed as the kernels' `[E, 2, I, H]`, as the model loads it).
Planted fault: SiLU in place of GELU-tanh leaves the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels.fused_moe import MoeLaunchConfig, fused_moe_reference, fused_moe_triton
from framework.layers.kernels.moe_epilogue import GELU_TANH_EPILOGUE, SILU_EPILOGUE

SMALL = MoeLaunchConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)
E, TOP_K, M = 4, 2, 6


def _case(h: int, i: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(x [M, H], gate_up [E, 2, I, H], down [E, H, I], routing weights [M, K] float32, ids [M, K])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, h, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2, i, h, generator=g) * 0.3).to(dtype)
    down = (torch.randn(E, h, i, generator=g) * 0.2).to(dtype)
    weights, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(TOP_K, dim=-1)
    return x, gate_up, down, weights, ids


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: summation order only; bfloat16: a flipped last-bit rounding of an intermediate at most."""
    tol = 1e-5 if ref.dtype == torch.float32 else 2**-5
    scale = ref.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


def test_reference_matches_transformers_gemma4_experts() -> None:
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    h, i = 32, 24
    cfg = Gemma4TextConfig(hidden_size=h, num_experts=E, top_k_experts=TOP_K, moe_intermediate_size=i)
    hf = Gemma4TextExperts(cfg)
    x, _, _, weights, ids = _case(h, i, torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.4)
        expected = hf(x, ids, weights)
    gate_up = hf.gate_up_proj.detach().view(E, 2, i, h)  # gate the first I rows
    got = fused_moe_reference(x, gate_up, hf.down_proj.detach(), weights, ids, GELU_TANH_EPILOGUE)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_kernel_matches_reference(dtype: torch.dtype) -> None:
    x, gate_up, down, weights, ids = _case(48, 40, dtype)  # partial K and N tiles
    ref = fused_moe_reference(x, gate_up, down, weights, ids, GELU_TANH_EPILOGUE)
    _assert_close(fused_moe_triton(x, gate_up, down, weights, ids, config=SMALL, epilogue=GELU_TANH_EPILOGUE), ref)


def test_planted_silu_leaves_the_tolerance() -> None:
    x, gate_up, down, weights, ids = _case(48, 40, torch.float32)
    ref = fused_moe_reference(x, gate_up, down, weights, ids, GELU_TANH_EPILOGUE)
    with pytest.raises(AssertionError):
        _assert_close(fused_moe_triton(x, gate_up, down, weights, ids, config=SMALL, epilogue=SILU_EPILOGUE), ref)
