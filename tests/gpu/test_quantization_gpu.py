"""FP8 weights on a CUDA GPU: the W8A16 kernel at the Qwen3-8B projections' shapes, and quantized checkpoints in an
engine (Triton kernels, CUDA graphs) against HF transformers on the dequantized weights.

Kernel claim: bf16 activations times FP8 weights widened to bf16 are exact products in float32, so the kernel and
the reference (dequantize in float32, matmul, round once) differ by summation order only: within one bf16 rounding
step of each value (or of the mean magnitude), at M = 1 (decode) to 2048 (prefill), block and per-channel scales.
W4A16 likewise (the zero-shifted 4-bit values are exact in bf16). Engine claim: a tiny quantized
checkpoint (FP8 block, per-channel, GPTQ act-order, AWQ) in float32 on the GPU gives HF's greedy tokens on the
dequantized model.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_quantization_gpu.py` (well under a minute on an H100).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from helpers.hf_models import hf_greedy, random_prompts  # noqa: E402
from helpers.quant_checkpoints import write_quantized  # noqa: E402

from framework.entrypoints.llm import LLM  # noqa: E402
from framework.layers.quantization.fp8 import quantize_fp8_per_channel  # noqa: E402
from framework.layers.quantization.triton_w4a16 import (  # noqa: E402
    pack_rows,
    w4a16_linear_reference,
    w4a16_linear_triton,
)
from framework.layers.quantization.triton_w8a16 import w8a16_linear_reference, w8a16_linear_triton  # noqa: E402
from framework.params.sampling_params import SamplingParams  # noqa: E402

# Qwen3-8B projections: (N, K)
SHAPES = {"q": (4096, 4096), "kv": (1024, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    tiles = w.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3))
    scale = tiles / 448.0
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (w / full).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("layout", ["block", "channel"])
@pytest.mark.parametrize("proj", list(SHAPES))
@pytest.mark.parametrize("m", [1, 8, 64, 2048])
def test_kernel_matches_reference_at_8b_shapes(layout: str, proj: str, m: int) -> None:
    n, k = SHAPES[proj]
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = torch.randn((n, k), device="cuda", generator=g) * k**-0.5
    if layout == "block":
        weight, scale = _block_quantize(w)
        groups = (128, 128)
    else:
        weight, scale = quantize_fp8_per_channel(w)
        groups = (1, k)
    x = torch.randn((m, k), device="cuda", generator=g).bfloat16()
    out = w8a16_linear_triton(x, weight, scale.contiguous(), *groups)
    ref = w8a16_linear_reference(x, weight, scale, *groups)
    ulp = 2**-7
    torch.testing.assert_close(out, ref, rtol=ulp, atol=ulp * ref.float().abs().mean().item())


@pytest.mark.parametrize("proj", list(SHAPES))
@pytest.mark.parametrize("m", [1, 8, 64, 2048])
def test_w4a16_kernel_matches_reference_at_8b_shapes(proj: str, m: int) -> None:
    n, k = SHAPES[proj]
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    q = torch.randint(0, 16, (n, k), device="cuda", generator=g, dtype=torch.uint8)
    scales = torch.rand((n, k // 128), device="cuda", generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 16, (n, k // 128), device="cuda", generator=g).float()
    x = torch.randn((m, k), device="cuda", generator=g).bfloat16()
    out = w4a16_linear_triton(x, pack_rows(q), scales, zeros, 128)
    ref = w4a16_linear_reference(x, pack_rows(q), scales, zeros, 128)
    ulp = 2**-7
    torch.testing.assert_close(out, ref, rtol=ulp, atol=ulp * ref.float().abs().mean().item())


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel", "gptq-act-asym", "awq"])
def test_engine_matches_hf_on_the_gpu(fmt: str, tmp_path: Path) -> None:
    ref = write_quantized(fmt, tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=64, seed=0)
    prompts = random_prompts(4, 4, 20, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(ref, prompt, 12)
