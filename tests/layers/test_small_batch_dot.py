"""The tensor-core small-batch kernel (framework/layers/kernels/triton_gemv_dot.py) against `fused_linear_reference`,
under the interpreter on the CPU (or for real on a GPU): every prologue / epilogue combination at M = 2, 3, 8, 16;
K not a multiple of the K chunk, N not a multiple of the row block (several programs, the last partial), strided
input rows; float32 and bfloat16 with the GEMV tests' tolerances (`assert_gemv_matches`). Plus the launch rules,
the sweep's candidate shapes (so the CUDA compile check compiles each), padding token columns never written, and
negative controls.
"""

from __future__ import annotations

import pytest
import torch
from test_small_batch_kernels import DEVICE, EPS, VARIANTS, _case, _run, assert_gemv_matches

from framework.layers.kernels.small_batch_ops import fused_linear_reference
from framework.layers.kernels.triton_gemv import gemv_tiles, gemv_triton
from framework.layers.kernels.triton_gemv_dot import _gemv_dot_kernel
from framework.layers.kernels.triton_norm_silu import interpreter_upcast

N, K = 40, 200  # 16-row tiles: 3 programs, the last half empty; 64-wide K chunks: 4, the last 8 wide


def _dot_tiles(m: int, n: int = N, k: int = K, **shape: int):
    return gemv_tiles(m, n, k, 4, dot=True, **({"block_n": 16, "block_k": 64} | shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 3, 8, 16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dot_matches_reference(dtype: torch.dtype, m: int, variant: str) -> None:
    out, summed, ref_out, ref_summed = _run(variant, m, N, K, dtype, seed=m, tiles=_dot_tiles(m))
    assert out.shape == (m, N) and out.is_contiguous()
    if variant == "logits":  # float32 out, rounded to the model dtype first
        assert out.dtype == torch.float32 and torch.equal(out, out.to(dtype).float())
    assert_gemv_matches(out, ref_out)
    if VARIANTS[variant][2]:
        assert summed is not None and torch.equal(summed, ref_summed)
    else:
        assert summed is None and ref_summed is None


def test_dot_default_tiles_and_float16() -> None:
    """The default rule (64-row tiles, one partial program here) and float16, which feeds the MMA directly."""
    tiles = gemv_tiles(5, 24, 200, 2)
    assert tiles.dot and tiles.block_n == 64 and tiles.block_m == 16
    out, summed, ref_out, ref_summed = _run("add_norm_silu_bias", 5, 24, 200, torch.float16, seed=5, tiles=tiles)
    assert_gemv_matches(out, ref_out)
    assert summed is not None and torch.equal(summed, ref_summed)


# (block_n, block_k, num_warps, num_stages): the shapes the H200 sweep timed (`bench_gemv_tiles.py`, removed; at
# commit 1e476a2), kept here so that each stays correct and the CUDA compile check compiles each.
DOT_CANDIDATES = [
    (16, 128, 1, 4),
    (32, 128, 2, 4),
    (32, 256, 2, 3),
    (64, 64, 4, 6),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (128, 128, 4, 4),
    (128, 128, 8, 4),
    (128, 64, 8, 6),
]


@pytest.mark.parametrize("block_n,block_k,num_warps,num_stages", DOT_CANDIDATES)
def test_every_swept_dot_shape_is_correct(block_n: int, block_k: int, num_warps: int, num_stages: int) -> None:
    """Each candidate the GPU sweep times, on a small bf16 gate/up case (and compiled for sm_90 by
    tests/gpu/compile_check.py)."""
    k = block_k + 24  # two chunks, the second partial
    tiles = gemv_tiles(
        4,
        24,
        k,
        2,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        dot=True,
        num_stages=num_stages,
        silu_mul=True,
    )
    out, _, ref_out, _ = _run("add_norm_silu", 4, 24, k, torch.bfloat16, seed=1, tiles=tiles)
    assert_gemv_matches(out, ref_out)


def test_launch_rules() -> None:
    """Default: the GEMV at one row, the dot from two; dot tiles cover N, pad the tokens to 16, 256 B K chunks."""
    assert not gemv_tiles(1, 4096, 1024, 2).dot and gemv_tiles(2, 4096, 1024, 2).dot
    assert not gemv_tiles(8, 4096, 1024, 2, dot=False).dot
    for n, k in ((4096, 1024), (1024, 2048), (3072, 1024), (1024, 3072), (151936, 1024), (6144, 4096)):
        for m in (2, 8, 16):
            tiles = gemv_tiles(m, n, k, 2)
            assert tiles.grid * tiles.block_n >= n > (tiles.grid - 1) * tiles.block_n
            assert tiles.block_m == 16 and tiles.block_k == 128 and tiles.num_stages >= 2
            assert tiles.block_n == (128 if n == 151936 else 64)
    assert gemv_tiles(3, 40, 20, 4, dot=True).block_k == 32  # a short K: one chunk, at least tl.dot's 16
    # Stages capped to the shared memory: 128 x 128 bf16 gate + up tiles (+ x^T) are 68 KB a stage.
    assert gemv_tiles(8, 12288, 4096, 2, block_n=128, num_stages=4, silu_mul=True).num_stages == 2
    assert gemv_tiles(8, 12288, 4096, 2, block_n=128, num_stages=4).num_stages == 4
    with pytest.raises(AssertionError, match="tl.dot"):
        gemv_tiles(3, 40, 96, 2, dot=True, block_n=8)


def _launch_into(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    residual: torch.Tensor,
    out: torch.Tensor,
    summed: torch.Tensor,
    m: int,
) -> None:
    """The dot kernel with the add + norm prologue, writing into the caller's [16, N] / [16, K] buffers; `m` is
    the kernel's M (the token columns its masks admit)."""
    n, k = weight.shape
    tiles = _dot_tiles(m, n, k)
    _gemv_dot_kernel[(tiles.grid,)](
        x,
        residual,
        norm_weight,
        weight,
        weight,
        out,
        summed,
        m,
        x.stride(0),
        residual.stride(0),
        EPS,
        N=n,
        K=k,
        BLOCK_MP=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        NUM_STAGES=tiles.num_stages,
        UPCAST=interpreter_upcast(x.dtype),
        HAS_NORM=True,
        HAS_RESIDUAL=True,
        HAS_BIAS=False,
        SILU_MUL=False,
        num_warps=tiles.num_warps,
    )


def _padding_untouched(m: int, kernel_m: int) -> bool:
    """3 real tokens in 16-row buffers whose padding rows hold other finite inputs and a -123 canary: run the
    kernel with M = kernel_m; True when rows >= m of the outputs are still the canary (real rows are checked)."""
    x, weight, _, norm_weight, residual = _case(16, N, K, torch.float32, seed=12)
    out = torch.full((16, N), -123.0, device=DEVICE)
    summed = torch.full((16, K), -123.0, device=DEVICE)
    _launch_into(x, weight, norm_weight, residual, out, summed, kernel_m)
    ref, ref_summed = fused_linear_reference(x[:m], weight, norm_weight=norm_weight, eps=EPS, residual=residual[:m])
    assert_gemv_matches(out[:m], ref)
    assert ref_summed is not None and torch.equal(summed[:m], ref_summed)
    return bool((out[m:] == -123.0).all() and (summed[m:] == -123.0).all())


def test_padding_token_columns_are_not_written() -> None:
    assert _padding_untouched(3, kernel_m=3)


def test_a_padding_mask_that_admits_every_column_is_caught() -> None:
    """Negative control: a kernel whose token mask covers all of BLOCK_MP (here: M = 16 on 3 real rows) writes
    the padding rows, and the check above sees it."""
    assert not _padding_untouched(3, kernel_m=16)


def test_a_swapped_gate_and_up_fails_the_comparison() -> None:
    """Negative control: the comparison sees a dot kernel that reads the up rows as gate rows."""
    x, weight, _, norm_weight, residual = _case(4, 16, 64, torch.bfloat16, seed=7, silu_mul=True)
    swapped = torch.cat([weight[16:], weight[:16]]).contiguous()
    kwargs = dict(norm_weight=norm_weight, eps=EPS, residual=residual, silu_mul=True)
    out, _ = gemv_triton(x, swapped, **kwargs, tiles=_dot_tiles(4, 16, 64))  # type: ignore[arg-type]
    ref, _ = fused_linear_reference(x, weight, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        assert_gemv_matches(out, ref)
