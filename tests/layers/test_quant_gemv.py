"""The small-M quantized GEMVs (framework/layers/quantization/triton_w8a16_gemv.py, triton_w4a16_gemv.py) against the
PyTorch references of the GEMM kernels (`w8a16_linear_reference`, `w4a16_linear_reference`), under the interpreter
on the CPU (or for real on a GPU), on awkward small shapes: M = 1, 3, 16 (16 in float32 only, for the
interpreter's time); odd N (a partial last program); K not a multiple of the chunk (chunks forced narrow, so
several chunks and a ragged last one run); FP8 block, per-channel and per-tensor scales; INT4 groups of 32 (several
per chunk), 192 (not a power of two: pieces of 64 columns) and the whole row; strided activation rows; with and
without bias. Negative controls: a wrong group's scales or zero points change the output (and planting a wrong
group index, a dropped zero point or a wrong nibble order in the kernels fails these tests).

Tolerance as tests/layers/test_w8a16_kernel.py: float32 differs by summation order only; float16 by one rounding
step (bfloat16 runs on a GPU: tests/gpu/test_quant_gemv_gpu.py, at the Qwen3-8B shapes).
"""

from __future__ import annotations

import pytest
import torch

from framework.layers.quantization.triton_w4a16 import pack_rows, w4a16_linear_reference
from framework.layers.quantization.triton_w4a16_gemv import w4a16_gemv_triton
from framework.layers.quantization.triton_w8a16 import w8a16_linear_reference
from framework.layers.quantization.triton_w8a16_gemv import quant_gemv_tiles, w8a16_gemv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_LAYOUTS = {"block": (128, 128), "channel": (1, None), "tensor": (None, None)}
# (M, activation dtype): M = 16 in float32 only, to keep the interpreter's time down
CASES = [(1, torch.float32), (3, torch.float32), (16, torch.float32), (3, torch.float16)]
CASES += [(1, torch.bfloat16), (16, torch.bfloat16)] if DEVICE == "cuda" else []


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        ulp = 2**-7 if out.dtype == torch.bfloat16 else 2**-10
        torch.testing.assert_close(out, ref, rtol=ulp, atol=ulp * ref.float().abs().mean().item())


def _x(m: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn((m, k + 8), generator=g)[:, 5 : 5 + k].to(DEVICE, dtype)  # strided rows


def _fp8_case(m: int, n: int, k: int, layout: str, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    group_n, group_k = FP8_LAYOUTS[layout]
    group_n, group_k = group_n or n, group_k or k
    weight = (torch.randn((n, k), generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand((-(-n // group_n), -(-k // group_k)), generator=g) * 1e-3 + 1e-4
    bias = torch.randn((n,), generator=g).to(DEVICE, dtype)
    return _x(m, k, dtype, g), weight.to(DEVICE), scale.to(DEVICE), group_n, group_k, bias


def _int4_case(m: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand((n, k // group), generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    bias = torch.randn((n,), generator=g).to(DEVICE, dtype)
    return _x(m, k, dtype, g), pack_rows(q).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), bias


@pytest.mark.parametrize("m,dtype", CASES)
@pytest.mark.parametrize("layout", list(FP8_LAYOUTS))
def test_fp8_gemv_matches_reference(m: int, layout: str, dtype: torch.dtype) -> None:
    n, k = 13, 320  # 320 = 2.5 chunks of 128 columns, two and a half scale blocks
    x, weight, scale, group_n, group_k, bias = _fp8_case(m, n, k, layout, dtype, seed=m)
    for tiles, b in ((None, bias), (quant_gemv_tiles(m, n, k, block_k=128), None)):
        out = w8a16_gemv_triton(x, weight, scale, group_n, group_k, b, tiles=tiles)
        assert out.dtype == dtype and out.shape == (m, n)
        _close(out, w8a16_linear_reference(x, weight, scale, group_n, group_k, b))


@pytest.mark.parametrize("m,dtype", CASES)
@pytest.mark.parametrize("group", [32, 192, 384])
def test_int4_gemv_matches_reference(m: int, group: int, dtype: torch.dtype) -> None:
    n, k = 13, 384  # chunks of 128 columns: 3 of them; groups of 32 = 4 a chunk, 192 straddles chunks
    x, qweight, scales, zeros, bias = _int4_case(m, n, k, group, dtype, seed=m + group)
    for tiles, b in ((None, bias), (quant_gemv_tiles(m, n, k, block_k=128), None)):
        out = w4a16_gemv_triton(x, qweight, scales, zeros, group, b, tiles=tiles)
        assert out.dtype == dtype and out.shape == (m, n)
        _close(out, w4a16_linear_reference(x, qweight, scales, zeros, group, b))


def test_gemv_reads_each_groups_scale_and_zero_point() -> None:
    """Negative controls: a wrong group's scales (FP8 blocks, INT4 groups) or zero points give another output, so the
    comparisons above would catch a kernel reading the wrong group at a boundary."""
    x, weight, scale, group_n, group_k, _ = _fp8_case(3, 13, 320, "block", torch.float32, seed=1)
    ref = w8a16_linear_reference(x, weight, scale, group_n, group_k)
    out = w8a16_gemv_triton(x, weight, scale.flip(1).contiguous(), group_n, group_k)
    assert not torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
    x, qweight, scales, zeros, _ = _int4_case(3, 13, 384, 32, torch.float32, seed=1)
    ref = w4a16_linear_reference(x, qweight, scales, zeros, 32)
    for s, z in ((scales, zeros.roll(1, dims=1)), (scales.roll(1, dims=1), zeros)):
        out = w4a16_gemv_triton(x, qweight, s.contiguous(), z.contiguous(), 32)
        assert not torch.allclose(out, ref, rtol=1e-3, atol=1e-3)


def test_gemv_tiles_fill_an_h100_at_n_4096() -> None:
    """At N = 4,096 (Qwen3-8B's o_proj / down) and N = 1,024 (its k / v) the launch has >= 2 programs per SM of 132."""
    assert quant_gemv_tiles(1, 4096, 4096).grid >= 264 and quant_gemv_tiles(16, 1024, 4096).grid >= 256
