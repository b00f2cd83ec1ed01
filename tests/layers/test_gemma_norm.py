"""Gemma's RMSNorms: Gemma 3's (`unit_offset=True`: `(1 + weight) * rmsnorm(x)`) and Gemma 4's (`float32_scale=True`:
`weight * rmsnorm(x)`), each in float32 and rounded once. The reference is checked bit for bit against HF
transformers' own `Gemma3RMSNorm` / `Gemma4RMSNorm`, and the Triton kernel (the interpreter here) against the
reference, with and without the residual add."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from framework.layers.kernels.layer_ops import rms_norm_reference
from framework.layers.kernels.triton_norm_silu import rms_norm_triton

EPS = 1e-6


def _hf_norm(weight: torch.Tensor) -> Gemma3RMSNorm:
    norm = Gemma3RMSNorm(weight.shape[0], eps=EPS).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_hf_gemma_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn((9, 96), generator=g) * 3).to(dtype)
    residual = torch.randn((9, 96), generator=g).to(dtype)
    weight = (torch.randn(96, generator=g) * 0.3).to(dtype)  # offsets from one, as Gemma checkpoints store them
    hf = _hf_norm(weight)
    out, summed = rms_norm_reference(x, weight, EPS, residual, unit_offset=True)
    assert summed is not None and torch.equal(summed, x + residual)
    with torch.no_grad():
        assert torch.equal(out, hf(x + residual))
        # a 16-bit `1 + weight` in the Llama-order norm is what the Gemma norm must not be
        if dtype == torch.bfloat16:
            assert not torch.equal(rms_norm_reference(x + residual, weight + 1, EPS)[0], hf(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_matches_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn((17, 160), generator=g) * 3).to(dtype)
    residual = torch.randn((17, 160), generator=g).to(dtype) if with_residual else None
    weight = (torch.randn(160, generator=g) * 0.3).to(dtype)
    out, summed = rms_norm_triton(x, weight, EPS, residual, unit_offset=True)
    ref, ref_summed = rms_norm_reference(x, weight, EPS, residual, unit_offset=True)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # one rounding of float32 values that differ only in summation order: at most a few ulp flips
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=2**-7)
        assert (out != ref).sum().item() <= 1 + 0.005 * ref.numel()
    assert (summed is None) == (residual is None)
    if summed is not None:
        assert torch.equal(summed, ref_summed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_scale_reference_equals_hf_gemma4_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn((9, 96), generator=g) * 3).to(dtype)
    weight = (1 + torch.randn(96, generator=g) * 0.3).to(dtype)  # Gemma 4 stores the scale itself
    hf = Gemma4RMSNorm(96, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        assert torch.equal(rms_norm_reference(x, weight, EPS, float32_scale=True)[0], hf(x))
        if dtype == torch.bfloat16:  # the Llama-order norm (rounded, then times weight in bf16) differs
            assert not torch.equal(rms_norm_reference(x, weight, EPS)[0], hf(x))
        unscaled = Gemma4RMSNorm(96, eps=EPS, with_scale=False)  # values / the router: ones in Llama order
        assert torch.equal(rms_norm_reference(x, torch.ones(96, dtype=dtype), EPS)[0], unscaled(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_float32_scale_kernel_matches_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(4)
    x = (torch.randn((17, 160), generator=g) * 3).to(dtype)
    residual = torch.randn((17, 160), generator=g).to(dtype) if with_residual else None
    weight = (1 + torch.randn(160, generator=g) * 0.3).to(dtype)
    out, summed = rms_norm_triton(x, weight, EPS, residual, float32_scale=True)
    ref, ref_summed = rms_norm_reference(x, weight, EPS, residual, float32_scale=True)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=2**-7)
        assert (out != ref).sum().item() <= 1 + 0.005 * ref.numel()
        assert not torch.equal(out, rms_norm_reference(x, weight, EPS, residual)[0])  # not the Llama order
    assert (summed is None) == (residual is None)
    if summed is not None:
        assert torch.equal(summed, ref_summed)
