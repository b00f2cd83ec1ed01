"""The small-M quantized GEMVs (framework/layers/quantization/triton_w8a16_gemv.py, triton_w4a16_gemv.py) on a CUDA GPU
at the Qwen3-8B projections' shapes, in bf16, against the GEMM kernels' PyTorch references; and under CUDA-graph
capture (what decode runs), where a replay must give the eager call's bits, run after run.

Claim: bf16 activations times the dequantized weight (FP8 x scale, or scale x (q - zero)) summed in float32 differ
from the reference (dequantize in float32, matmul, round once) by summation order only: within one bf16 rounding
step of each value, or of the mean magnitude. Compiles one kernel per (kind, shape, M): `BLOCK_M` 1, 4, 16.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_quant_gemv_gpu.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from framework.layers.quantization.fp8 import quantize_fp8_per_channel  # noqa: E402
from framework.layers.quantization.triton_w4a16 import pack_rows, w4a16_linear_reference  # noqa: E402
from framework.layers.quantization.triton_w4a16_gemv import w4a16_gemv_triton  # noqa: E402
from framework.layers.quantization.triton_w8a16 import w8a16_linear_reference  # noqa: E402
from framework.layers.quantization.triton_w8a16_gemv import w8a16_gemv_triton  # noqa: E402

# Qwen3-8B projections: (N, K)
SHAPES = {"q": (4096, 4096), "kv": (1024, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ULP = 2**-7


def _fp8(n: int, k: int, layout: str, g: torch.Generator):  # type: ignore[no-untyped-def]
    w = torch.randn((n, k), device="cuda", generator=g) * k**-0.5
    if layout == "channel":
        weight, scale = quantize_fp8_per_channel(w)
        return weight, scale, 1, k
    if layout == "tensor":
        scale = w.abs().amax().reshape(1, 1) / 448
        return (w / scale).to(torch.float8_e4m3fn), scale, n, k
    tiles = w.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448
    full = tiles.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (w / full).to(torch.float8_e4m3fn), tiles.contiguous(), 128, 128


def _int4(n: int, k: int, g: torch.Generator):  # type: ignore[no-untyped-def]
    q = torch.randint(0, 16, (n, k), device="cuda", generator=g, dtype=torch.uint8)
    scales = torch.rand((n, k // 128), device="cuda", generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 16, (n, k // 128), device="cuda", generator=g).float()
    return pack_rows(q), scales, zeros, 128


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, rtol=ULP, atol=ULP * ref.float().abs().mean().item())


# Every projection with block scales; per channel on two (the same code but for where the scale multiplies): each
# (kind, shape, M) compiles its own kernel, and the file's piece has 110 s
FP8_CASES = [("block", proj) for proj in SHAPES] + [("channel", "q"), ("channel", "down")]


@pytest.mark.parametrize("layout,proj", FP8_CASES)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_fp8_gemv_matches_reference_at_8b_shapes(layout: str, proj: str, m: int) -> None:
    n, k = SHAPES[proj]
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    weight, scale, group_n, group_k = _fp8(n, k, layout, g)
    x = torch.randn((m, k), device="cuda", generator=g).bfloat16()
    bias = torch.randn((n,), device="cuda", generator=g).bfloat16() if proj == "kv" else None
    out = w8a16_gemv_triton(x, weight, scale, group_n, group_k, bias)
    _close(out, w8a16_linear_reference(x, weight, scale, group_n, group_k, bias))


@pytest.mark.parametrize("m", [1, 4, 16])
def test_fp8_per_tensor_gemv_matches_reference(m: int) -> None:
    n, k = SHAPES["kv"]
    g = torch.Generator(device="cuda").manual_seed(m)
    weight, scale, group_n, group_k = _fp8(n, k, "tensor", g)
    x = torch.randn((m, k), device="cuda", generator=g).bfloat16()
    _close(w8a16_gemv_triton(x, weight, scale, group_n, group_k), w8a16_linear_reference(x, weight, scale, n, k))


@pytest.mark.parametrize("proj", list(SHAPES))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_int4_gemv_matches_reference_at_8b_shapes(proj: str, m: int) -> None:
    n, k = SHAPES[proj]
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    qweight, scales, zeros, group = _int4(n, k, g)
    x = torch.randn((m, k), device="cuda", generator=g).bfloat16()
    out = w4a16_gemv_triton(x, qweight, scales, zeros, group)
    _close(out, w4a16_linear_reference(x, qweight, scales, zeros, group))


def test_gemvs_replay_in_cuda_graphs_with_the_eager_bits() -> None:
    """Captured (no host sync, fixed-shape outputs) and replayed: the eager call's bits, twice (no atomics, no
    split-K order that could vary)."""
    n, k = SHAPES["q"]
    g = torch.Generator(device="cuda").manual_seed(0)
    weight, scale, group_n, group_k = _fp8(n, k, "block", g)
    qweight, scales, zeros, group = _int4(n, k, g)
    x = torch.randn((4, k), device="cuda", generator=g).bfloat16()
    eager = (w8a16_gemv_triton(x, weight, scale, group_n, group_k), w4a16_gemv_triton(x, qweight, scales, zeros, group))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = (
            w8a16_gemv_triton(x, weight, scale, group_n, group_k),
            w4a16_gemv_triton(x, qweight, scales, zeros, group),
        )
    for _ in range(2):
        for out in captured:
            out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, eager))
