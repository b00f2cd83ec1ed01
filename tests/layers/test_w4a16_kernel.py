"""The W4A16 kernel (framework/layers/quantization/triton_w4a16.py) against its reference, under the interpreter on
the CPU (or for real on a GPU): M from 1 to past one 128-row tile, N not a multiple of the tiles, group sizes 16
(K chunks of two packed words), 32, 64 and the whole row, with and without bias, zero points 0..16 (GPTQ's reach
up to 16); and the packing helpers against a hand-built int32.

Tolerance: as tests/layers/test_w8a16_kernel.py (the zero-shifted 4-bit values are exact in 16-bit floats, so only
the float32 summation order and the final rounding differ); bfloat16 on a GPU only, for the same interpreter reason.
"""

from __future__ import annotations

import pytest
import torch

from framework.layers.quantization.triton_w4a16 import (
    pack_rows,
    unpack_rows,
    w4a16_linear_reference,
    w4a16_linear_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand((n, k // group), generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 17, (n, k // group), generator=g).float()
    x = torch.randn((m, k + 8), generator=g)[:, 3 : 3 + k]
    bias = torch.randn((n,), generator=g)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(x).to(dtype), to(pack_rows(q)), to(scales), to(zeros), to(bias).to(dtype)


@pytest.mark.parametrize("m", [1, 5, 130])
@pytest.mark.parametrize("group", [16, 32, 64, 192])  # 16: two words a K chunk, a group per chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_kernel_matches_reference(m: int, group: int, dtype: torch.dtype) -> None:
    x, qweight, scales, zeros, bias = _case(m, 200, 192, group, dtype, seed=m + group)
    for b in (None, bias):
        out = w4a16_linear_triton(x, qweight, scales, zeros, group, b)
        ref = w4a16_linear_reference(x, qweight, scales, zeros, group, b)
        assert out.dtype == dtype and out.shape == (m, 200)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:
            ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
            torch.testing.assert_close(out, ref, rtol=ulp, atol=ulp * ref.float().abs().mean().item())


def test_packing_order() -> None:
    """Column 8c + j is bits 4j..4j+3 of int32 c (a hand-built word: 0x87654321 holds 1, 2, ..., 8)."""
    word = torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32)
    assert unpack_rows(word).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert torch.equal(pack_rows(unpack_rows(word)), word)


def test_kernel_reads_each_groups_zero_point() -> None:
    """Negative control: zero points shifted by one group change the output beyond the tolerance."""
    x, qweight, scales, zeros, _ = _case(3, 200, 192, 64, torch.float32, seed=1)
    ref = w4a16_linear_reference(x, qweight, scales, zeros, 64)
    out = w4a16_linear_triton(x, qweight, scales, zeros.roll(1, dims=1).contiguous(), 64)
    assert not torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
