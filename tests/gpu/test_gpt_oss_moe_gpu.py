"""gpt-oss's experts in the fused MoE kernels on a CUDA GPU, at the gpt-oss-20b geometry (E = 32, top-4,
H = I = 2880), bf16 activations, M = 1 (decode), 64 and 2048 (prefill): every launch configuration.

- bf16 experts with biases and the clamped SwiGLU (`MoeEpilogue`) against `fused_moe_reference` (cuBLAS per
  expert, the same roundings): within one bf16 rounding step of the intermediates;
- MXFP4 experts (uint8 blocks, E8M0 scales, dequantized in registers) against `fused_moe_quant_reference`
  (dequantized to float32, float32 products rounded once): the same bound; the e2m1 value times its power of two
  is exact in bf16, so only summation order and the intermediates' roundings differ.
- engine: tiny gpt-oss checkpoints (bf16 experts, and MXFP4 in the released layout) in float32 through the engine
  (the kernels, CUDA graphs) give HF's greedy tokens (HF on the experts as transformers dequantizes them).
The weights are scaled so that the clamp (limit 7) bites on a share of the gate and up values. A handful of
elements may sit one more rounding step out (a flipped rounding of an intermediate feeding a sum of 2880 terms):
at most 1 in 10^4 beyond the bound, none beyond 4x.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_gpt_oss_moe_gpu.py` (under a minute on an H100).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from pathlib import Path  # noqa: E402

from helpers.hf_models import hf_greedy, random_prompts  # noqa: E402
from helpers.mxfp4_checkpoints import build_gpt_oss, write_gpt_oss_mxfp4  # noqa: E402
from test_gpt_oss_kernels import CLAMPING_SPEC  # noqa: E402

from framework.entrypoints.llm import LLM  # noqa: E402
from framework.layers.kernels.fused_moe import fused_moe_reference, fused_moe_triton  # noqa: E402
from framework.layers.kernels.fused_moe_quant import (  # noqa: E402
    QuantExperts,
    fused_moe_quant_reference,
    fused_moe_quant_triton,
)
from framework.layers.kernels.moe_epilogue import CLAMPED_SWIGLU, MoeEpilogue  # noqa: E402

E, TOP_K, H, I = 32, 4, 2880, 2880
ULP = 2**-7  # one bf16 rounding step


def _randn(g: torch.Generator, *shape: int, scale: float) -> torch.Tensor:
    return (torch.randn(shape, device="cuda", generator=g) * scale).bfloat16()


def _epilogue(g: torch.Generator) -> MoeEpilogue:
    return MoeEpilogue(CLAMPED_SWIGLU, 1.702, 7.0, _randn(g, E, 2, I, scale=0.5), _randn(g, E, H, scale=0.5))


def _routing(m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn((m, H), device="cuda", generator=g).bfloat16()
    weights, ids = torch.softmax(torch.randn((m, E), device="cuda", generator=g), -1).topk(TOP_K, dim=-1)
    return x, weights.bfloat16(), ids


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref.float()).abs()
    bound = 2 * ULP * (ref.float().abs() + ref.float().abs().mean())
    outside = (err > bound).float().mean().item()
    assert outside <= 1e-4, f"{outside:.2e} of the elements beyond the bound (max err {err.max().item():.3e})"
    assert bool((err <= 4 * bound).all()), f"max err {err.max().item():.3e}"


def _clamped_share(x: torch.Tensor, gate_up_row: torch.Tensor) -> float:
    return ((x.float() @ gate_up_row.float().T).abs() > 7.0).float().mean().item()


@pytest.mark.parametrize("m", [1, 64, 2048])
def test_bf16_experts_with_biases_and_clamped_swiglu(m: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(11)
    gate_up, down = _randn(g, E, 2, I, H, scale=0.15), _randn(g, E, H, I, scale=0.02)
    epilogue = _epilogue(g)
    x, weights, ids = _routing(m)
    assert _clamped_share(x, gate_up[0, 0]) > 0.05, "the clamp should bite"
    out = fused_moe_triton(x, gate_up, down, weights, ids, epilogue=epilogue)
    _assert_close(out, fused_moe_reference(x, gate_up, down, weights, ids, epilogue))


@pytest.mark.parametrize("m", [1, 64, 2048])
def test_mxfp4_experts_with_biases_and_clamped_swiglu(m: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(12)
    blocks = lambda *s: torch.randint(0, 256, s, device="cuda", generator=g, dtype=torch.uint8)  # noqa: E731
    scales = lambda lo, *s: torch.randint(lo, lo + 3, s, device="cuda", generator=g, dtype=torch.uint8)  # noqa: E731
    experts = QuantExperts(
        "mxfp4", blocks(E, 2, I, H // 2), blocks(E, H, I // 2), scales(122, E, 2, I, H // 32),
        scales(118, E, H, I // 32), (1, 32), (1, 32),
    )  # fmt: skip
    epilogue = _epilogue(g)
    x, weights, ids = _routing(m)
    out = fused_moe_quant_triton(x, experts, weights, ids, epilogue=epilogue)
    _assert_close(out, fused_moe_quant_reference(x, experts, weights, ids, epilogue))


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_tiny_gpt_oss_engine_matches_hf(fmt: str, tmp_path: Path) -> None:
    from framework.params.sampling_params import SamplingParams

    if fmt == "mxfp4":
        hf = write_gpt_oss_mxfp4(CLAMPING_SPEC, tmp_path)
    else:
        hf = build_gpt_oss(CLAMPING_SPEC)
        hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=64, seed=0)
    prompts = random_prompts(4, 4, 30, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 12)
