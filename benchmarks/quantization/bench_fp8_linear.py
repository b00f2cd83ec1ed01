"""FP8- and INT4-weight linear layers against bf16 `F.linear` (cuBLAS) at the Qwen3-8B projections' shapes.

For each projection and token count M: the median time of the W8A16 Triton kernel (block 128 x 128 scales), of the
W4A16 kernel (group 128), of the W8A8 path (per-token-group activation quantization + FP8 x FP8 GEMM: its crossing
with W8A16 is what `W8A8_MIN_TOKENS` in framework/layers/quantization/fp8.py should be), of the per-channel W8A8
path through cuBLASLt (per-token activation quantization + `torch._scaled_mm`, `scaled_mm_w8a8`) and of the bf16
GEMM, and
the kernels' achieved bandwidth (weight bytes + activations in and out, per second) and TFLOP/s. Decode (small M)
is bound by reading the weight: FP8 reads half the bytes, INT4 a quarter. Up to `QUANT_GEMV_MAX_ROWS` tokens also the
small-M GEMVs the methods run there (`fp8 gemv`, `int4 gemv` columns: `triton_w8a16_gemv`, `triton_w4a16_gemv`;
`-` above). Prints a table, writes JSON.

    PYTHONPATH=$PWD python benchmarks/quantization/bench_fp8_linear.py [--out fp8_linear.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn import functional as F

from benchmarks.cuda_timing import median_event_ms
from framework.layers.quantization.fp8 import quantize_fp8_per_channel
from framework.layers.quantization.scaled_mm_w8a8 import w8a8_linear_scaled_mm
from framework.layers.quantization.triton_w4a16 import w4a16_linear_triton
from framework.layers.quantization.triton_w4a16_gemv import w4a16_gemv_triton
from framework.layers.quantization.triton_w8a8 import quantize_fp8_groups, w8a8_linear_triton
from framework.layers.quantization.triton_w8a16 import w8a16_linear_triton
from framework.layers.quantization.triton_w8a16_gemv import QUANT_GEMV_MAX_ROWS, w8a16_gemv_triton

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def _median_ms(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    return median_event_ms(fn, reps, warmup=5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="fp8_linear.json")
    args = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}")
    print(
        f"{'proj':8} {'M':>5} {'bf16 ms':>9} {'fp8 ms':>9} {'x':>5} {'GB/s':>6} {'TFLOP/s':>8} {'int4 ms':>9} "
        f"{'x':>5} {'GB/s':>6} {'w8a8 ms':>9} {'x':>5} {'cublas ms':>9} {'x':>5} {'fp8 gemv ms':>11} {'x':>5} "
        f"{'GB/s':>6} {'int4 gemv ms':>12} {'x':>5} {'GB/s':>6}"
    )
    for name, (n, k) in SHAPES.items():
        w = torch.randn((n, k), device="cuda") * k**-0.5
        w16 = w.bfloat16()
        w8, channel_scale = quantize_fp8_per_channel(w)
        scale = (torch.rand((n // 128, k // 128), device="cuda") + 0.5) / 448
        q4 = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
        s4 = torch.rand((n, k // 128), device="cuda") * 0.01
        z4 = torch.full((n, k // 128), 8.0, device="cuda")
        del w
        for m in TOKENS:
            x = torch.randn((m, k), device="cuda").bfloat16()
            t16 = _median_ms(lambda: F.linear(x, w16))  # noqa: B023
            t8 = _median_ms(lambda: w8a16_linear_triton(x, w8, scale, 128, 128))  # noqa: B023
            t4 = _median_ms(lambda: w4a16_linear_triton(x, q4, s4, z4, 128))  # noqa: B023

            def w8a8() -> torch.Tensor:
                xq, sx = quantize_fp8_groups(x, 128, use_kernel=True)  # noqa: B023
                return w8a8_linear_triton(xq, sx, 128, w8, scale, 128, 128, torch.bfloat16)  # noqa: B023

            t88 = _median_ms(w8a8)

            def cublas() -> torch.Tensor:
                xq, sx = quantize_fp8_groups(x, k, use_kernel=True)  # noqa: B023
                return w8a8_linear_scaled_mm(xq, sx, w8, channel_scale)  # noqa: B023

            tc = _median_ms(cublas)
            gemv = m <= QUANT_GEMV_MAX_ROWS
            t8g = _median_ms(lambda: w8a16_gemv_triton(x, w8, scale, 128, 128)) if gemv else float("nan")  # noqa: B023
            t4g = _median_ms(lambda: w4a16_gemv_triton(x, q4, s4, z4, 128)) if gemv else float("nan")  # noqa: B023
            moved = n * k + 2 * m * (k + n) + scale.numel() * 4
            moved4 = n * k // 2 + 2 * m * (k + n) + s4.numel() * 8
            row = {
                "proj": name,
                "N": n,
                "K": k,
                "M": m,
                "bf16_ms": t16,
                "fp8_ms": t8,
                "speedup": t16 / t8,
                "fp8_GBps": moved / t8 / 1e6,
                "fp8_TFLOPs": 2 * m * n * k / t8 / 1e9,
                "w8a8_ms": t88,
                "w8a8_speedup": t16 / t88,
                "w8a8_TFLOPs": 2 * m * n * k / t88 / 1e9,
                "cublas_w8a8_ms": tc,
                "cublas_w8a8_speedup": t16 / tc,
                "cublas_w8a8_TFLOPs": 2 * m * n * k / tc / 1e9,
                "int4_ms": t4,
                "int4_speedup": t16 / t4,
                "int4_GBps": moved4 / t4 / 1e6,
                "fp8_gemv_ms": t8g if gemv else None,
                "fp8_gemv_speedup": t16 / t8g if gemv else None,
                "fp8_gemv_GBps": moved / t8g / 1e6 if gemv else None,
                "int4_gemv_ms": t4g if gemv else None,
                "int4_gemv_speedup": t16 / t4g if gemv else None,
                "int4_gemv_GBps": moved4 / t4g / 1e6 if gemv else None,
            }
            gemv_cols = (
                f"{t8g:11.4f} {t16 / t8g:5.2f} {moved / t8g / 1e6:6.0f} {t4g:12.4f} {t16 / t4g:5.2f} "
                f"{moved4 / t4g / 1e6:6.0f}"
                if gemv
                else f"{'-':>11} {'-':>5} {'-':>6} {'-':>12} {'-':>5} {'-':>6}"
            )
            rows.append(row)
            print(
                f"{name:8} {m:5d} {t16:9.4f} {t8:9.4f} {t16 / t8:5.2f} {row['fp8_GBps']:6.0f} {row['fp8_TFLOPs']:8.1f} "
                f"{t4:9.4f} {t16 / t4:5.2f} {row['int4_GBps']:6.0f} {t88:9.4f} {t16 / t88:5.2f} "
                f"{tc:9.4f} {t16 / tc:5.2f} {gemv_cols}"
            )
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
