"""gpt-oss's experts in the fused MoE kernels, gpt-oss-20b geometry (one layer): bf16 and MXFP4.

Geometry: 32 experts, top-4, hidden 2880, expert intermediate 2880. For each token count M (routing: softmax top-4
of random logits) the median time of: the bf16 kernels with SiLU-and-mul and no biases (what a Qwen-style layer
runs: compare with main's to see that the epilogue switches cost the old path nothing), the bf16 kernels with
gpt-oss's biases and clamped SwiGLU, and the MXFP4 kernels with the same epilogue; the MXFP4 speedup over bf16 and
its bandwidth over the expert bytes it must read (each routed expert once: half a byte a weight plus one exponent
per 32) and TFLOP/s.

    PYTHONPATH=$PWD python benchmarks/quantization/bench_gpt_oss_moe.py [--out gpt_oss_moe.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.cuda_timing import median_event_ms
from framework.layers.kernels.fused_moe import fused_moe_triton
from framework.layers.kernels.fused_moe_quant import QuantExperts, fused_moe_quant_triton
from framework.layers.kernels.moe_epilogue import CLAMPED_SWIGLU, MoeEpilogue

E, TOP_K, H, I = 32, 4, 2880, 2880
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def _median_ms(fn, reps: int = 30) -> float:  # type: ignore[no-untyped-def]
    return median_event_ms(fn, reps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpt_oss_moe.json")
    args = parser.parse_args()
    gate_up = torch.randn((E, 2, I, H), device="cuda").mul_(H**-0.5).bfloat16()
    down = torch.randn((E, H, I), device="cuda").mul_(I**-0.5).bfloat16()
    epilogue = MoeEpilogue(
        CLAMPED_SWIGLU, 1.702, 7.0, torch.zeros((E, 2, I), device="cuda").bfloat16(),
        torch.zeros((E, H), device="cuda").bfloat16(),
    )  # fmt: skip
    blocks = lambda *s: torch.randint(0, 256, s, device="cuda", dtype=torch.uint8)  # noqa: E731
    scales = lambda *s: torch.full(s, 120, device="cuda", dtype=torch.uint8)  # noqa: E731
    mxfp4 = QuantExperts(
        "mxfp4", blocks(E, 2, I, H // 2), blocks(E, H, I // 2), scales(E, 2, I, H // 32), scales(E, H, I // 32),
        (1, 32), (1, 32),
    )  # fmt: skip
    rows = []
    print(torch.cuda.get_device_name())
    head = f"{'M':>5} {'experts':>7} {'silu ms':>9} {'gpt-oss ms':>10}"
    print(f"{head} {'mxfp4 ms':>9} {'x':>5} {'GB/s':>6} {'TFLOP/s':>8}")
    for m in TOKENS:
        x = torch.randn((m, H), device="cuda").bfloat16()
        weights, ids = torch.softmax(torch.randn((m, E), device="cuda"), -1).topk(TOP_K, dim=-1)
        routed = int(ids.unique().numel())
        t_silu = _median_ms(lambda: fused_moe_triton(x, gate_up, down, weights, ids))  # noqa: B023
        t_bf16 = _median_ms(lambda: fused_moe_triton(x, gate_up, down, weights, ids, epilogue=epilogue))  # noqa: B023
        t_fp4 = _median_ms(lambda: fused_moe_quant_triton(x, mxfp4, weights, ids, epilogue=epilogue))  # noqa: B023
        weight_bytes = routed * 3 * I * H * (0.5 + 1 / 32)
        row = {
            "M": m,
            "routed_experts": routed,
            "bf16_silu_ms": t_silu,
            "bf16_gpt_oss_ms": t_bf16,
            "mxfp4_ms": t_fp4,
            "mxfp4_speedup": t_bf16 / t_fp4,
            "mxfp4_GBps": (weight_bytes + 4 * m * H) / t_fp4 / 1e6,
            "mxfp4_TFLOPs": 2 * m * TOP_K * 3 * I * H / t_fp4 / 1e9,
        }
        rows.append(row)
        print(
            f"{m:5d} {routed:7d} {t_silu:9.4f} {t_bf16:10.4f} {t_fp4:9.4f} {t_bf16 / t_fp4:5.2f} "
            f"{row['mxfp4_GBps']:6.0f} {row['mxfp4_TFLOPs']:8.1f}"
        )
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "geometry": [E, TOP_K, H, I], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
