"""The W8A16 kernel (framework/layers/quantization/triton_w8a16.py) against its reference, under the interpreter
on the CPU (or for real on a GPU), on small awkward shapes: M from 1 (decode) to past one 128-row tile, N and K
not multiples of the tiles or of the 128 x 128 scale blocks, every scale layout (block, per channel, per tensor),
with and without bias.

Tolerance: float32 differs from the reference by summation order only; 16-bit activations round the float32
result once, as the reference does, so an element may differ by one rounding step of its magnitude. bfloat16 runs
on a GPU only: the interpreter of Triton 3.9 multiplies bfloat16 `tl.dot` operands wrongly (float16 runs here);
tests/gpu/test_quantization_gpu.py covers bfloat16 at real shapes.
"""

from __future__ import annotations

import pytest
import torch

from framework.layers.quantization.triton_w8a16 import dequantize_fp8, w8a16_linear_reference, w8a16_linear_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = {"block": (128, 128), "channel": (1, None), "tensor": (None, None)}


def _case(m: int, n: int, k: int, layout: str, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    group_n, group_k = LAYOUTS[layout]
    group_n, group_k = group_n or n, group_k or k
    weight = (torch.randn((n, k), generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand((-(-n // group_n), -(-k // group_k)), generator=g) * 1e-3 + 1e-4
    x = (torch.randn((m, k + 8), generator=g))[:, 5 : 5 + k]  # strided rows
    bias = torch.randn((n,), generator=g)
    return x.to(DEVICE, dtype), weight.to(DEVICE), scale.to(DEVICE), group_n, group_k, bias.to(DEVICE, dtype)


@pytest.mark.parametrize("m", [1, 3, 17, 130])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_kernel_matches_reference(m: int, layout: str, dtype: torch.dtype) -> None:
    x, weight, scale, group_n, group_k, bias = _case(m, 200, 320, layout, dtype, seed=m)
    for b in (None, bias):
        out = w8a16_linear_triton(x, weight, scale, group_n, group_k, b)
        ref = w8a16_linear_reference(x, weight, scale, group_n, group_k, b)
        assert out.dtype == dtype and out.shape == (m, 200)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:
            ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
            torch.testing.assert_close(out, ref, rtol=ulp, atol=ulp * ref.float().abs().mean().item())


def test_reference_is_the_dequantized_matmul() -> None:
    """The reference's weight is each FP8 value times the scale of its tile (a hand-built 2 x 2 grid of tiles)."""
    weight = torch.ones((130, 140), dtype=torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    dense = dequantize_fp8(weight, scale, 128, 128)
    assert dense[0, 0] == 1 and dense[0, 139] == 2 and dense[129, 0] == 3 and dense[129, 139] == 4
    assert dense[127, 127] == 1 and dense[128, 128] == 4
    x = torch.ones((1, 140))
    y = w8a16_linear_reference(x, weight, scale, 128, 128)
    assert y[0, 0] == 128 * 1 + 12 * 2 and y[0, 129] == 128 * 3 + 12 * 4


def test_kernel_applies_each_tiles_scale() -> None:
    """Negative control for the comparison above: a wrong scale tile changes the kernel's output (the scales
    matter to the test, so a kernel reading the wrong tile would fail it)."""
    x, weight, scale, group_n, group_k, _ = _case(3, 200, 320, "block", torch.float32, seed=1)
    ref = w8a16_linear_reference(x, weight, scale, group_n, group_k)
    swapped = scale.flip(1).contiguous()
    out = w8a16_linear_triton(x, weight, swapped, group_n, group_k)
    assert not torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
