"""The small-M GEMV kernel (framework/layers/kernels/triton_gemv.py) against `fused_linear_reference`, under the
interpreter on the CPU (or for real on a GPU), on small awkward shapes: M = 1, 3, 8, 16; K not a multiple of
the K chunk; N not a multiple of the row block; every prologue / epilogue combination.

Tolerances: float32 differs from the reference by summation order only (rtol = atol = 1e-5). bfloat16 / float16
round at the same points as the reference, so almost every element is bit-identical; a different float32
summation order can tip one rounding of a projection output, which SiLU * up can carry: at most 2% of the
elements may differ, each by at most 2 ulps of the row scale.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import framework.layers.kernels.small_batch_ops as small_batch_ops
from framework.layers.kernels.small_batch_ops import fused_linear, fused_linear_reference
from framework.layers.kernels.triton_gemv import MAX_GEMV_ROWS, GemvTiles, gemv_tiles, gemv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(DEVICE, dtype)


def assert_gemv_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The tolerances of the module docstring."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    ulp = 2**-7 if ref.dtype == torch.bfloat16 else 2**-10
    scale = ref.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(out, ref, rtol=2 * ulp, atol=2 * ulp * scale)
    differ = (out != ref).sum().item()
    assert differ <= 1 + 0.02 * ref.numel(), f"{differ} of {ref.numel()} elements differ from the reference"


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int, silu_mul: bool = False):
    """x [M, K] with strided rows, weight [N or 2N, K] scaled like a trained projection, bias, norm weight,
    residual."""
    x = _randn((m, k + 8), dtype, seed, 2.0)[:, 3 : 3 + k]
    weight = _randn((2 * n if silu_mul else n, k), dtype, seed + 1, k**-0.5)
    bias = _randn((weight.shape[0],), dtype, seed + 2, 0.5)
    norm_weight = _randn((k,), dtype, seed + 3, 0.2, 1.0)
    residual = _randn((m, k), dtype, seed + 4, 3.0)
    return x, weight, bias, norm_weight, residual


VARIANTS = {  # name -> (bias, norm, residual, silu_mul, float32 out)
    "plain": (False, False, False, False, False),  # o_proj, down_proj
    "bias": (True, False, False, False, False),
    "norm": (False, True, False, False, False),  # the first layer's qkv (no residual yet)
    "add_norm_bias": (True, True, True, False, False),  # qkv of Qwen2 (q/k/v bias)
    "add_norm_silu": (False, True, True, True, False),  # gate_up
    "add_norm_silu_bias": (True, True, True, True, False),
    "logits": (False, False, False, False, True),  # LM head: float32 out
}


def _run(variant: str, m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, tiles: Optional[GemvTiles] = None):
    """gemv_triton and the reference on one case; `tiles` None: the GEMV kernel at every M."""
    has_bias, has_norm, has_residual, silu_mul, fp32_out = VARIANTS[variant]
    x, weight, bias, norm_weight, residual = _case(m, n, k, dtype, seed, silu_mul)
    kwargs = dict(
        bias=bias if has_bias else None,
        norm_weight=norm_weight if has_norm else None,
        eps=EPS,
        residual=residual if has_residual else None,
        silu_mul=silu_mul,
        out_dtype=torch.float32 if fp32_out else None,
    )
    x_before = x.clone()
    tiles = tiles or gemv_tiles(m, n, k, weight.element_size())
    out, summed = gemv_triton(x, weight, **kwargs, tiles=tiles)  # type: ignore[arg-type]
    ref_out, ref_summed = fused_linear_reference(x, weight, **kwargs)  # type: ignore[arg-type]
    assert torch.equal(x, x_before)  # inputs are not written
    return out, summed, ref_out, ref_summed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gemv_matches_reference(dtype: torch.dtype, m: int, variant: str) -> None:
    n, k = 18, 300 if dtype == torch.bfloat16 else 200  # K: 2 chunks, the last partly masked; N: a partial block
    out, summed, ref_out, ref_summed = _run(variant, m, n, k, dtype, seed=m)
    assert out.shape == (m, n) and out.is_contiguous()
    if variant == "logits":  # float32 out, rounded to the model dtype first (as `.float()` of a projection)
        assert out.dtype == torch.float32 and torch.equal(out, out.to(dtype).float())
    assert_gemv_matches(out, ref_out)
    if VARIANTS[variant][2]:
        assert summed is not None and torch.equal(summed, ref_summed)  # one rounded add: exact in every dtype
    else:
        assert summed is None and ref_summed is None


def test_gemv_float16_sixteen_rows_and_zero_rows() -> None:
    out, summed, ref_out, ref_summed = _run("add_norm_silu_bias", MAX_GEMV_ROWS, 24, 200, torch.float16, seed=5)
    assert_gemv_matches(out, ref_out)
    assert summed is not None and torch.equal(summed, ref_summed)
    x, weight, _, norm_weight, residual = _case(3, 8, 64, torch.bfloat16, seed=6)
    empty, empty_summed = gemv_triton(x[:0], weight, norm_weight=norm_weight, eps=EPS, residual=residual[:0])
    assert empty.shape == (0, 8) and empty_summed is not None and empty_summed.shape == (0, 64)


def test_a_swapped_gate_and_up_fails_the_comparison() -> None:
    """Negative control: the comparison sees a kernel that reads the up rows as gate rows."""
    x, weight, _, norm_weight, residual = _case(2, 16, 64, torch.float32, seed=7, silu_mul=True)
    swapped = torch.cat([weight[16:], weight[:16]]).contiguous()
    out, _ = gemv_triton(x, swapped, norm_weight=norm_weight, eps=EPS, residual=residual, silu_mul=True)
    ref, _ = fused_linear_reference(x, weight, norm_weight=norm_weight, eps=EPS, residual=residual, silu_mul=True)
    with pytest.raises(AssertionError):
        assert_gemv_matches(out, ref)


def test_tiles_cover_the_output_and_fill_an_h200_at_real_shapes() -> None:
    for n, k in ((4096, 1024), (1024, 2048), (3072, 1024), (1024, 3072), (151936, 1024), (6144, 4096)):
        tiles = gemv_tiles(8, n, k, 2)
        assert tiles.grid * tiles.block_n >= n > (tiles.grid - 1) * tiles.block_n
        assert tiles.grid >= 128 and tiles.block_m == 8  # about a program per SM of an H200 (132) at least
        assert tiles.num_warps == tiles.block_n  # a warp per weight row: the K reduction needs no barrier
        assert tiles.block_k == 1024  # 2 KB of each weight row per chunk
    assert gemv_tiles(1, 151936, 1024, 2).grid == 18992
    assert gemv_tiles(3, 40, 96, 4) == (4, 8, 128, 5, 8, 128)
    assert gemv_tiles(3, 40, 96, 4, block_n=2, block_k=32, num_warps=1) == (4, 2, 32, 20, 1, 128)


# ---- dispatch ------------------------------------------------------------------------------------------


T = "triton"  # `backend=T`: the Triton path forced, as `kernels.backend=triton` does


@pytest.fixture
def gemv_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the row count of every GEMV launch (the tests force the Triton path with `backend=T`)."""
    calls: list[int] = []

    def spy(x: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return gemv_triton(x, *args, **kwargs)

    monkeypatch.setattr(small_batch_ops, "gemv_triton", spy)
    return calls


def test_dispatch_takes_the_kernel_for_supported_inputs(gemv_calls: list[int]) -> None:
    x, weight, bias, norm_weight, residual = _case(4, 16, 64, torch.bfloat16, seed=8)
    fused_linear(x, weight, bias, norm_weight, EPS, residual, backend=T)
    fused_linear(x, weight, out_dtype=torch.float32, backend=T)
    assert gemv_calls == [4, 4]


def test_dispatch_falls_back_to_the_reference_for_unsupported_inputs(gemv_calls: list[int]) -> None:
    x, weight, _, norm_weight, _ = _case(MAX_GEMV_ROWS + 1, 16, 64, torch.float32, seed=9)
    cases: list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = [
        (x, weight, None),  # 17 rows: a GEMM's job
        (x[:2].double(), weight.double(), None),  # float64
        (x[:2], weight.t().contiguous().t(), None),  # a column-major weight
        (x[:2], weight, norm_weight.half()),  # a norm weight of another dtype
    ]
    for xs, w, nw in cases:
        out, _ = fused_linear(xs, w, norm_weight=nw, eps=EPS, backend=T)
        ref, _ = fused_linear_reference(xs, w, norm_weight=nw, eps=EPS)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert gemv_calls == []


def test_bad_shapes_are_refused_with_a_clear_error() -> None:
    x, weight, *_ = _case(2, 15, 64, torch.float32, seed=10)
    with pytest.raises(ValueError, match="silu_mul needs a merged"):
        fused_linear(x, weight, silu_mul=True)
    with pytest.raises(ValueError, match="do not multiply"):
        fused_linear(x[:, :32], weight)


def test_reference_mode_and_cpu_default_take_the_reference(gemv_calls: list[int]) -> None:
    x, weight, *_ = _case(2, 16, 64, torch.float32, seed=11)
    fused_linear(x, weight, backend="reference")  # kernels.backend: the same setting as attention and the layer ops
    if DEVICE == "cpu":
        fused_linear(x, weight)  # auto: the reference on a CPU
    assert gemv_calls == []
