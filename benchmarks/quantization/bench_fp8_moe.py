"""The fused MoE MLP over FP8 block / INT4 experts against bf16 experts, Qwen3-30B-A3B geometry (one layer).

Geometry: 128 experts, top-8, hidden 2048, expert intermediate 768; FP8 with 128 x 128 block scales
(Qwen3-30B-A3B-FP8), INT4 with group 128 and zero points. For each token count M (routing: softmax top-8 of random
logits): the median time of the bf16 kernels (`fused_moe_triton`), the FP8 W8A16 and INT4 ones
(`fused_moe_quant_triton`), the FP8 W8A8 path (`fused_moe_w8a8_triton`: activations quantized per token and
128-input group, FP8 x FP8 expert GEMMs; the quantization of x is timed with it), the speedups over bf16, the
quantized kernels' bandwidth over the expert bytes they must read (each routed expert read once) and TFLOP/s.
Decode is bound by reading the routed experts: FP8 halves the bytes, INT4 quarters them. Where W8A8 overtakes
W8A16 is what `MOE_W8A8_MIN_TOKENS` (framework/layers/quantization/moe.py) should be; rows/expert is M * 8 / 128.

    PYTHONPATH=$PWD python benchmarks/quantization/bench_fp8_moe.py [--out fp8_moe.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.cuda_timing import median_event_ms
from framework.layers.kernels.fused_moe import fused_moe_triton
from framework.layers.kernels.fused_moe_quant import QuantExperts, fused_moe_quant_triton
from framework.layers.quantization.triton_moe_w8a8 import fused_moe_w8a8_triton

E, TOP_K, H, I = 128, 8, 2048, 768
TOKENS = (1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 8192)


def _median_ms(fn, reps: int = 30) -> float:  # type: ignore[no-untyped-def]
    return median_event_ms(fn, reps)


def _experts() -> tuple[torch.Tensor, torch.Tensor, QuantExperts, QuantExperts]:
    gate_up = torch.randn((E, 2, I, H), device="cuda").mul_(H**-0.5)
    down = torch.randn((E, H, I), device="cuda").mul_(I**-0.5)
    s1 = torch.full((E, 2, I // 128, H // 128), 1 / 448 * 4 * H**-0.5, device="cuda")
    s2 = torch.full((E, H // 128, I // 128), 1 / 448 * 4 * I**-0.5, device="cuda")
    fp8 = QuantExperts(
        "fp8", (gate_up / s1[0, 0, 0, 0]).clamp(-448, 448).to(torch.float8_e4m3fn),
        (down / s2[0, 0, 0]).clamp(-448, 448).to(torch.float8_e4m3fn),
        s1, s2, (128, 128), (128, 128),
    )  # fmt: skip
    words = lambda *s: torch.randint(-(2**31), 2**31 - 1, s, device="cuda", dtype=torch.int32)  # noqa: E731
    int4 = QuantExperts(
        "int4", words(E, 2, I, H // 8), words(E, H, I // 8),
        torch.full((E, 2, I, H // 128), 1e-3, device="cuda"), torch.full((E, H, I // 128), 1e-3, device="cuda"),
        (1, 128), (1, 128),
        torch.full((E, 2, I, H // 128), 8.0, device="cuda"), torch.full((E, H, I // 128), 8.0, device="cuda"),
    )  # fmt: skip
    return gate_up.bfloat16(), down.bfloat16(), fp8, int4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="fp8_moe.json")
    args = parser.parse_args()
    gate_up, down, fp8, int4 = _experts()
    rows = []
    print(torch.cuda.get_device_name())
    head = f"{'M':>5} {'experts':>7} {'bf16 ms':>9} {'w8a16 ms':>9} {'x':>5} {'GB/s':>6} {'TFLOP/s':>8}"
    print(f"{head} {'w8a8 ms':>9} {'x':>5} {'TFLOP/s':>8} {'int4 ms':>9} {'x':>5}")
    for m in TOKENS:
        x = torch.randn((m, H), device="cuda").bfloat16()
        weights, ids = torch.softmax(torch.randn((m, E), device="cuda"), -1).topk(TOP_K, dim=-1)
        routed = int(ids.unique().numel())
        t16 = _median_ms(lambda: fused_moe_triton(x, gate_up, down, weights, ids))  # noqa: B023
        t8 = _median_ms(lambda: fused_moe_quant_triton(x, fp8, weights, ids))  # noqa: B023
        t88 = _median_ms(lambda: fused_moe_w8a8_triton(x, fp8, weights, ids, 128))  # noqa: B023
        t4 = _median_ms(lambda: fused_moe_quant_triton(x, int4, weights, ids))  # noqa: B023
        flops = 2 * m * TOP_K * 3 * I * H
        weight_bytes = routed * 3 * I * H  # FP8: one byte per weight
        row = {
            "M": m,
            "routed_experts": routed,
            "bf16_ms": t16,
            "fp8_ms": t8,
            "fp8_speedup": t16 / t8,
            "fp8_GBps": (weight_bytes + 4 * m * H) / t8 / 1e6,
            "fp8_TFLOPs": flops / t8 / 1e9,
            "w8a8_ms": t88,
            "w8a8_speedup": t16 / t88,
            "w8a8_over_w8a16": t8 / t88,
            "w8a8_TFLOPs": flops / t88 / 1e9,
            "int4_ms": t4,
            "int4_speedup": t16 / t4,
            "int4_GBps": (weight_bytes / 2 + 4 * m * H) / t4 / 1e6,
        }
        rows.append(row)
        print(
            f"{m:5d} {routed:7d} {t16:9.4f} {t8:9.4f} {t16 / t8:5.2f} {row['fp8_GBps']:6.0f} {row['fp8_TFLOPs']:8.1f} "
            f"{t88:9.4f} {t16 / t88:5.2f} {row['w8a8_TFLOPs']:8.1f} {t4:9.4f} {t16 / t4:5.2f}"
        )
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "geometry": [E, TOP_K, H, I], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
