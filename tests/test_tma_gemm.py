"""The TMA GEMM (framework/kernels/triton_tma_gemm.py) against `fused_linear_reference` (`F.linear`, then
`silu_and_mul`), under the interpreter on the CPU (or for real on a GPU): plain and SiLU * up, one K split and
several (the last split's K range partly or wholly past K), M and N not multiples of their tiles, strided
16-byte aligned input rows, bfloat16 and float16. Plus: the counters are back at zero after a launch (a CUDA
graph replays on the same buffer), the rule's shapes, what TMA cannot read, and a negative control.
"""

from __future__ import annotations

import pytest
import torch

from framework.kernels.small_batch_ops import fused_linear_reference
from framework.kernels.triton_tma_gemm import TmaGemmConfig, tma_gemm, tma_gemm_config, tma_gemm_takes
from test_small_batch_kernels import DEVICE, _randn, assert_gemv_matches

# (block_n, block_m, block_k, split_k, num_warps, num_stages): 16-row / 16-token tiles so that small cases have
# several tiles in both directions; K = 200 in 64-wide boxes: split 2 -> 128 + 72, split 4 -> 64 x 3 + 8.
SMALL = TmaGemmConfig(16, 16, 64, 1, 4, 2)


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int, silu_mul: bool = False):
    """x [M, K] with strided rows (16-byte aligned: what TMA reads), weight [N or 2N, K] scaled like a trained
    projection."""
    x = _randn((m, k + 8), dtype, seed, 2.0)[:, 8:8 + k]
    weight = _randn((2 * n if silu_mul else n, k), dtype, seed + 1, k**-0.5)
    return x, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_tma_gemm_matches_reference(dtype: torch.dtype, split_k: int, silu_mul: bool) -> None:
    m, n, k = 37, 40, 200  # 3 token tiles (the last 5 tokens), 3 weight-row tiles (the last 8 rows)
    x, weight = _case(m, n, k, dtype, seed=split_k, silu_mul=silu_mul)
    assert tma_gemm_takes(x, weight)
    x_before = x.clone()
    out = tma_gemm(x, weight, silu_mul, config=SMALL._replace(split_k=split_k))
    ref, _ = fused_linear_reference(x, weight, None, silu_mul=silu_mul)
    assert torch.equal(x, x_before) and out.shape == (m, n) and out.is_contiguous()
    assert_gemv_matches(out, ref)


def test_rule_config_matches_reference() -> None:
    """The rule's own launch (128-row tiles, K split while the tiles fill less than a wave) on a small case."""
    x, weight = _case(20, 48, 1024, torch.bfloat16, seed=7)
    cfg = tma_gemm_config(20, 48, 1024)
    assert cfg.split_k > 1
    ref, _ = fused_linear_reference(x, weight, None)
    assert_gemv_matches(tma_gemm(x, weight), ref)


def test_counters_return_to_zero_and_results_repeat() -> None:
    """A shared counter buffer is all zeros after each launch, and a second launch on it gives the same bits."""
    x, weight = _case(20, 48, 256, torch.bfloat16, seed=3, silu_mul=True)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    cfg = SMALL._replace(split_k=4)
    first = tma_gemm(x, weight, True, cfg, counters)
    assert torch.count_nonzero(counters) == 0
    second = tma_gemm(x, weight, True, cfg, counters)
    assert torch.count_nonzero(counters) == 0 and torch.equal(first, second)


def test_rule_shapes() -> None:
    """Decode shapes of the 8B geometry: tiles up to 128 tokens, splits until a wave of 132 SMs is filled."""
    assert tma_gemm_config(128, 24576 // 2, 4096) == TmaGemmConfig(128, 128, 64, 2, 4, 4)  # 96 tiles -> 192
    assert tma_gemm_config(128, 6144, 4096).split_k == 4  # 48 tiles -> 192 programs
    assert tma_gemm_config(256, 6144, 4096).split_k == 2  # 96 tiles -> 192 programs
    assert tma_gemm_config(17, 1024, 128).split_k == 1  # K too short to split
    assert tma_gemm_config(5, 1024, 1024).block_m == 16


def test_takes_only_what_tma_reads() -> None:
    x, weight = _case(4, 16, 64, torch.bfloat16, seed=1)
    assert tma_gemm_takes(x, weight)
    assert not tma_gemm_takes(x.float(), weight.float())  # float32 is not taken (TF32 MMA would round it)
    assert not tma_gemm_takes(x[:, 1:33], weight[:, :32])  # base 2 bytes past a 16-byte boundary
    odd = _randn((4, 67), torch.bfloat16, 2, 1.0)[:, :64]  # rows 134 bytes apart
    assert not tma_gemm_takes(odd, weight)
    assert not tma_gemm_takes(x, weight.half())


def test_negative_control_wrong_weight_rows_detected() -> None:
    """The comparison catches a product against the wrong rows (the up half in place of the gate half)."""
    x, weight = _case(8, 16, 64, torch.bfloat16, seed=5, silu_mul=True)
    swapped = torch.cat([weight[16:], weight[:16]])
    ref, _ = fused_linear_reference(x, weight, None, silu_mul=True)
    with pytest.raises(AssertionError):
        assert_gemv_matches(tma_gemm(x, swapped, True, SMALL), ref)
