"""The split-K GEMM of the mid-batch projections (framework/kernels/triton_gemm.py) against `fused_linear_reference`
(`F.linear`, then `silu_and_mul`), under the interpreter on the CPU (or for real on a GPU): plain, bias, SiLU * up
with and without bias; one split and several (the last split's K range partly or wholly past K); M and N not
multiples of their tiles, strided input rows; float32 and bfloat16 with the GEMV tests' tolerances. Plus: the
counters are back at zero after every launch (a CUDA graph replays on the same buffer), the result does not
depend on the split count beyond rounding nor on launch order, the rule's shapes, and negative controls.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from framework.kernels.small_batch_ops import fused_linear_reference
from framework.kernels.split_counters import SplitCounters
from framework.kernels.triton_gemm import GemmConfig, gemm_config, gemm_triton
from test_small_batch_kernels import DEVICE, _case, assert_gemv_matches

# (block_n, block_m, block_k, split_k, num_warps, num_stages): 16-row / 16-token tiles so small cases have
# several tiles in both directions; K = 200 in 64-wide chunks: split 2 -> 128 + 72, split 4 -> 64 x 3 + 8.
SMALL = GemmConfig(16, 16, 64, 1, 4, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("bias,silu_mul", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_matches_reference(dtype: torch.dtype, split_k: int, bias: bool, silu_mul: bool) -> None:
    m, n, k = 37, 40, 200  # 3 token tiles (the last 5 tokens), 3 weight-row tiles (the last 8 rows)
    x, weight, b, _, _ = _case(m, n, k, dtype, seed=split_k, silu_mul=silu_mul)
    x_before = x.clone()
    out = gemm_triton(x, weight, b if bias else None, silu_mul, config=SMALL._replace(split_k=split_k))
    ref, _ = fused_linear_reference(x, weight, b if bias else None, silu_mul=silu_mul)
    assert torch.equal(x, x_before) and out.shape == (m, n) and out.is_contiguous()
    assert_gemv_matches(out, ref)


def test_counters_return_to_zero_and_results_repeat() -> None:
    """A shared counter buffer (as `SplitCounters` hands one out) is all zeros after each launch, and a second
    launch on it gives the same bits: the state a CUDA-graph replay relies on."""
    x, weight, b, _, _ = _case(20, 48, 256, torch.bfloat16, seed=3, silu_mul=True)
    counters = SplitCounters()
    cfg = SMALL._replace(split_k=4)
    first = gemm_triton(x, weight, b, True, counters=counters, config=cfg)
    buffer = counters.get(torch.device(DEVICE), 1)
    assert buffer is not None and torch.count_nonzero(buffer) == 0
    second = gemm_triton(x, weight, b, True, counters=counters, config=cfg)
    assert torch.count_nonzero(buffer) == 0 and torch.equal(first, second)


def test_split_count_changes_only_rounding() -> None:
    """float32: one split and eight agree to float32 rounding (the sum's association differs, nothing else)."""
    x, weight, _, _, _ = _case(24, 32, 512, torch.float32, seed=4)
    one = gemm_triton(x, weight, config=SMALL)
    eight = gemm_triton(x, weight, config=SMALL._replace(split_k=8))
    torch.testing.assert_close(one, eight, rtol=1e-5, atol=1e-5)


def test_zero_rows() -> None:
    x = torch.zeros(0, 64, device=DEVICE)
    assert gemm_triton(x, torch.ones(32, 64, device=DEVICE)).shape == (0, 32)


@pytest.mark.parametrize("m,n,k,silu_mul", [(256, 1024, 2048, False), (64, 1024, 3072, False),
                                            (128, 4096, 1024, False), (256, 3072, 1024, True),
                                            (32, 4096, 4096, False)])
def test_rule_fills_the_gpu_and_keeps_chunks(m: int, n: int, k: int, silu_mul: bool) -> None:
    """The rule's split: tiles x splits within one wave of 132 SMs, every split at least 4 K chunks, stages
    within shared memory."""
    cfg = gemm_config(m, n, k, 2, silu_mul)
    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    assert tiles * cfg.split_k <= max(132, tiles)
    assert k // cfg.split_k >= 4 * cfg.block_k or cfg.split_k == 1
    assert ((2 if silu_mul else 1) * cfg.block_n + cfg.block_m) * cfg.block_k * 2 * cfg.num_stages <= 192 * 1024
    if tiles * 2 <= 132 and k >= 8 * cfg.block_k:
        assert cfg.split_k > 1  # a small output is split


def test_negative_control_unreset_counters_break_the_next_launch() -> None:
    """The check above can fail: counters left at a nonzero value (as without the reset) make the next
    launch's tiles finish early or never, so its result is wrong."""
    x, weight, _, _, _ = _case(16, 16, 256, torch.float32, seed=5)
    counters = SplitCounters()
    buffer = counters.get(torch.device(DEVICE), 1)
    assert buffer is not None
    buffer.fill_(1)  # one split of every tile already "counted"
    out = gemm_triton(x, weight, counters=counters, config=SMALL._replace(split_k=4))
    ref, _ = fused_linear_reference(x, weight)
    assert not torch.allclose(out, ref, rtol=1e-3, atol=1e-3)


SWEEP = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "bench_projections.py"),
                       run_name="bench_projections")


@pytest.mark.parametrize("cfg", sorted(set(SWEEP["candidates"](256)) | set(SWEEP["candidates"](64))), ids=str)
def test_every_swept_shape_is_correct(cfg: GemmConfig) -> None:
    """Each launch shape the GPU sweep times, on a small bf16 gate/up case (and compiled for sm_90 by
    scripts/triton_cuda_compile_check.py before GPU time is spent)."""
    x, weight, b, _, _ = _case(20, 24, 300, torch.bfloat16, seed=6, silu_mul=True)
    out = gemm_triton(x, weight, b, True, config=cfg)
    assert_gemv_matches(out, fused_linear_reference(x, weight, b, silu_mul=True)[0])
