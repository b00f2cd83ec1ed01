"""FP8 weights on a CUDA GPU: the W8A16 kernel at the Qwen3-8B projections' shapes, and quantized checkpoints in an
engine (Triton kernels, CUDA graphs) against HF transformers on the dequantized weights.

Kernel claim: bf16 activations times FP8 weights widened to bf16 are exact products in float32, so the kernel and
the reference (dequantize in float32, matmul, round once) differ by summation order only: within one bf16 rounding
step of each value (or of the mean magnitude), at M = 1 (decode) to 2048 (prefill), block and per-channel scales.
W4A16 likewise (the zero-shifted 4-bit values are exact in bf16). Engine claim: a tiny quantized
checkpoint (FP8 block, per-channel, GPTQ act-order, AWQ) in float32 on the GPU gives HF's greedy tokens on the
dequantized model. Quantized MoE: the fused MoE kernels over FP8 block and INT4 experts at the Qwen3-30B-A3B
geometry against their reference, the W8A8 MoE kernels (FP8 activations) against theirs and against W8A16, and
tiny quantized Qwen3-MoE checkpoints in an engine against HF.
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

from helpers.hf_models import hf_greedy, hf_logits, random_prompts  # noqa: E402
from helpers.quant_checkpoints import write_quantized  # noqa: E402

from framework.entrypoints.llm import LLM  # noqa: E402
from framework.layers.kernels.fused_moe_quant import (  # noqa: E402
    QuantExperts,
    fused_moe_quant_reference,
    fused_moe_quant_triton,
)
from framework.layers.quantization.fp8 import quantize_fp8_per_channel  # noqa: E402
from framework.layers.quantization.scaled_mm_w8a8 import scaled_mm_applies, w8a8_linear_scaled_mm  # noqa: E402
from framework.layers.quantization.triton_moe_w8a8 import (  # noqa: E402
    fused_moe_w8a8_reference,
    fused_moe_w8a8_triton,
)
from framework.layers.quantization.triton_w4a16 import (  # noqa: E402
    pack_rows,
    w4a16_linear_reference,
    w4a16_linear_triton,
)
from framework.layers.quantization.triton_w8a8 import (  # noqa: E402
    quantize_fp8_groups,
    quantize_fp8_groups_reference,
    w8a8_linear_reference,
    w8a8_linear_triton,
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["block", "channel"])
@pytest.mark.parametrize("nk", [(256, 192), (320, 192), (192, 320)])
@pytest.mark.parametrize("m", [1, 4, 17, 48, 130])
def test_w8a16_kernel_at_the_tiny_models_shapes(dtype: torch.dtype, layout: str, nk: tuple[int, int], m: int) -> None:
    """The tiny quantized test models' projections (N, K not multiples of 128; K inside one or several groups), in
    both activation dtypes, at every launch configuration's row count."""
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = torch.randn((n, k), device="cuda", generator=g) * 0.1
    if layout == "block":
        scale = torch.rand((-(-n // 128), -(-k // 128)), device="cuda", generator=g) * 1e-3 + 1e-3
        weight, groups = (w / 2e-3).clamp(-448, 448).to(torch.float8_e4m3fn), (128, 128)
    else:
        (weight, scale), groups = quantize_fp8_per_channel(w), (1, k)
    x = torch.randn((m, k), device="cuda", generator=g).to(dtype)
    out = w8a16_linear_triton(x, weight, scale.contiguous(), *groups)
    ref = w8a16_linear_reference(x, weight, scale, *groups)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * ref.float().abs().mean().item())


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
    """Weight-only everywhere (`fp8_activation_min_tokens=None`): the dequantized model's greedy tokens, with the
    kernels and every kind of CUDA graph."""
    ref = write_quantized(fmt, tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=64, seed=0, fp8_activation_min_tokens=None)
    prompts = random_prompts(4, 4, 20, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(ref, prompt, 12)


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel"])
def test_fp8_activations_in_padded_prefill_graphs_stay_close_to_hf(fmt: str, tmp_path: Path) -> None:
    """The default threshold: a short prefill replays the prefill pieces captured at 512 tokens, so its FP8 layers
    quantize their activations (W8A8) while decode stays W8A16. Teacher-forced on the engine's own tokens, HF on
    the dequantized weights gives each token a logprob within 0.5 of the engine's (0.1 on average) and ranks it among
    its five likeliest: FP8 activation rounding moves logits (and so may flip a near-tie, even in the first token), it
    does not scramble them. With the threshold off (the test
    above) the tokens are equal."""
    ref = write_quantized(fmt, tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=64, seed=0)
    prompts = random_prompts(4, 4, 20, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    diffs = []
    for prompt, out in zip(prompts, outs):
        tokens = list(out.token_ids)
        with torch.no_grad():
            logits = hf_logits(ref, prompt + tokens[:-1])[len(prompt) - 1 :]
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = torch.tensor(tokens)
        want = logprobs[torch.arange(len(tokens)), chosen]
        # Every token is among HF's five likeliest at its step: the rounding reorders near-ties, nothing more.
        assert (logprobs.topk(5, dim=-1).indices == chosen[:, None]).any(-1).all(), (tokens, logprobs.argmax(-1))
        diffs.append(torch.tensor([step[t].logprob for step, t in zip(out.logprobs, tokens)]) - want)
    # Measured on an H100: max 0.14 to 0.26 per prompt, mean 0.05 to 0.07 (random tiny weights, large logits); a
    # wrong scale or a lost activation group moves logprobs by whole units.
    diff = torch.cat(diffs).abs()
    assert diff.max().item() < 0.5 and diff.mean().item() < 0.1, diffs


# Qwen3-30B-A3B experts: E = 128, top-8, H = 2048, I = 768 (FP8 block 128 x 128; INT4 group 128).
MOE_E, MOE_K, MOE_H, MOE_I = 128, 8, 2048, 768


def _moe_experts(kind: str) -> QuantExperts:
    g = torch.Generator(device="cuda").manual_seed(7)
    e, h, i = MOE_E, MOE_H, MOE_I
    if kind in ("fp8", "fp8-channel"):
        w1 = (torch.randn((e, 2, i, h), device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
        w2 = (torch.randn((e, h, i), device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
        if kind == "fp8-channel":  # FP8_DYNAMIC / online FP8: one scale per output channel
            s1 = torch.rand((e, 2, i, 1), device="cuda", generator=g) * 2e-4 + 1e-4
            s2 = torch.rand((e, h, 1), device="cuda", generator=g) * 2e-4 + 1e-4
            return QuantExperts("fp8", w1, w2, s1, s2, (1, h), (1, i))
        s1 = torch.rand((e, 2, i // 128, h // 128), device="cuda", generator=g) * 2e-4 + 1e-4
        s2 = torch.rand((e, h // 128, i // 128), device="cuda", generator=g) * 2e-4 + 1e-4
        return QuantExperts("fp8", w1, w2, s1, s2, (128, 128), (128, 128))
    words = lambda *s: torch.randint(-(2**31), 2**31 - 1, s, device="cuda", generator=g, dtype=torch.int32)  # noqa: E731
    scale = lambda *s: torch.rand(s, device="cuda", generator=g) * 2e-3 + 1e-3  # noqa: E731
    zeros = lambda *s: torch.randint(0, 16, s, device="cuda", generator=g).float()  # noqa: E731
    return QuantExperts(
        "int4",
        words(e, 2, i, h // 8),
        words(e, h, i // 8),
        scale(e, 2, i, h // 128),
        scale(e, h, i // 128),
        (1, 128),
        (1, 128),
        zeros(e, 2, i, h // 128),
        zeros(e, h, i // 128),
    )


@pytest.mark.parametrize("kind", ["fp8", "int4"])
@pytest.mark.parametrize("m", [1, 16, 256, 2048])
def test_quantized_moe_kernel_matches_reference_at_30b_a3b_shapes(kind: str, m: int) -> None:
    """The fused MoE kernels over FP8 block / INT4 experts against the dequantize-then-MoE reference, decode to
    prefill row counts (every launch configuration)."""
    experts = _moe_experts(kind)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn((m, MOE_H), device="cuda", generator=g).bfloat16()
    weights, ids = torch.softmax(torch.randn((m, MOE_E), device="cuda", generator=g), -1).topk(MOE_K, dim=-1)
    out = fused_moe_quant_triton(x, experts, weights, ids)
    ref = fused_moe_quant_reference(x, experts, weights, ids)
    ulp = 2**-6  # one bf16 rounding of the intermediates (gate, up, act) either way
    atol = ulp * ref.float().abs().mean().item()
    # An output near zero that sums eight experts' rounded terms may land a little past atol (1-2 of 4.2M elements at
    # M = 2048 on an H100): every element within 4x the tolerance, at most one in 100,000 past it.
    torch.testing.assert_close(out, ref, rtol=4 * ulp, atol=4 * atol)
    past = ((out.float() - ref.float()).abs() > atol + ulp * ref.float().abs()).float().mean().item()
    assert past <= 1e-5, f"{past:.2e} of the outputs are past the bf16 tolerance"


def _rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


@pytest.mark.parametrize("kind", ["fp8", "fp8-channel"])
@pytest.mark.parametrize("m", [256, 2048])
def test_w8a8_moe_kernel_matches_reference_at_30b_a3b_shapes(kind: str, m: int) -> None:
    """FP8 x FP8 expert GEMMs (block FP8: activations per token and 128-input group, the intermediate quantized in the
    gate/up kernel; per-channel: per token, the intermediate quantized after it) against the reference (the same
    activation quantization, dequantized, float32 products). Hopper's FP8 MMA sums a chunk with fewer mantissa bits
    than float32, which can flip a bf16 rounding of gate or up and, rarely, an e4m3 rounding of the intermediate;
    hence an RMS tolerance. Against the W8A16 kernels: the FP8 activations' error (a few percent), not less."""
    experts = _moe_experts(kind)
    group = 128 if kind == "fp8" else None
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn((m, MOE_H), device="cuda", generator=g).bfloat16()
    weights, ids = torch.softmax(torch.randn((m, MOE_E), device="cuda", generator=g), -1).topk(MOE_K, dim=-1)
    out = fused_moe_w8a8_triton(x, experts, weights, ids, group)
    ref = fused_moe_w8a8_reference(x, experts, weights, ids, group)
    err = _rms(out.float() - ref.float()) / _rms(ref)
    assert err < 2**-6, f"W8A8 kernel vs reference: {err:.2e} of the output's RMS"
    # Elementwise: a flipped e4m3 rounding of one intermediate moves its output past rms/8 (4 of 4.2M elements at
    # M = 2048 on an H100): every element within 4x that, at most one in 100,000 past it.
    tol = 2**-3 * _rms(ref)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-1, atol=4 * tol)
    past = ((out.float() - ref.float()).abs() > tol + 2**-3 * ref.float().abs()).float().mean().item()
    assert past <= 1e-5, f"{past:.2e} of the outputs are past rms/8"
    w8a16 = fused_moe_quant_triton(x, experts, weights, ids)
    fp8_err = _rms(out.float() - w8a16.float()) / _rms(w8a16)
    assert 2**-8 < fp8_err < 2**-4, f"W8A8 vs W8A16 kernels: {fp8_err:.2e} of the output's RMS"


@pytest.mark.parametrize("fmt", ["fp8-block", "gptq", "ct-w4a16"])
def test_quantized_moe_engine_matches_hf_on_the_gpu(fmt: str, tmp_path: Path) -> None:
    """A tiny quantized Qwen3-MoE checkpoint (per-expert tensors) through the engine (kernels, CUDA graphs)."""
    from helpers.hf_models import TinySpec

    spec = TinySpec(
        "qwen3moe-quant",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            "hidden_size": 256,
            "intermediate_size": 256,
            "moe_intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "initializer_range": 0.1,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        },
        seed=21,
    )
    ref = write_quantized(fmt, tmp_path, spec)
    weight_only = {"fp8_activation_min_tokens": None, "fp8_moe_activation_min_tokens": None}  # exact tokens
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=64, seed=0, **weight_only)
    prompts = random_prompts(4, 4, 20, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(ref, prompt, 12)


@pytest.mark.parametrize("group", [128, 4096])
def test_activation_quantization_kernel_is_exact(group: int) -> None:
    """Per token-group (block FP8) and per token (K = 4096): scales and e4m3 values equal the reference's."""
    x = torch.randn((333, 4096), device="cuda").bfloat16() * 3
    q, s = quantize_fp8_groups(x, group, use_kernel=True)
    q_ref, s_ref = quantize_fp8_groups_reference(x, group)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("layout", ["block", "channel"])
@pytest.mark.parametrize("proj", list(SHAPES))
@pytest.mark.parametrize("m", [128, 2048])
def test_w8a8_kernel_matches_reference_at_8b_shapes(layout: str, proj: str, m: int) -> None:
    """The FP8 x FP8 GEMM against dequantize-both-then-matmul; Hopper's FP8 MMA accumulates with fewer mantissa
    bits per chunk than float32, hence a tolerance of a few bf16 steps."""
    n, k = SHAPES[proj]
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = torch.randn((n, k), device="cuda", generator=g) * k**-0.5
    weight, scale = _block_quantize(w) if layout == "block" else quantize_fp8_per_channel(w)
    groups = (128, 128) if layout == "block" else (1, k)
    group_x = 128 if layout == "block" else k
    xq, sx = quantize_fp8_groups_reference(torch.randn((m, k), device="cuda", generator=g), group_x)
    out = w8a8_linear_triton(xq, sx, group_x, weight, scale.contiguous(), *groups, torch.bfloat16)
    ref = w8a8_linear_reference(xq, sx, group_x, weight, scale, *groups, torch.bfloat16)
    ulp = 2**-6
    torch.testing.assert_close(out, ref, rtol=ulp, atol=ulp * ref.float().abs().mean().item())


@pytest.mark.parametrize("proj", list(SHAPES))
@pytest.mark.parametrize("m", [1, 64, 2048])
def test_scaled_mm_w8a8_matches_reference_at_8b_shapes(proj: str, m: int) -> None:
    """cuBLASLt's FP8 GEMM (per-token x per-channel row-wise scales) against dequantize-both-then-matmul, and the
    predicate that routes per-channel layers to it on this card."""
    n, k = SHAPES[proj]
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    weight, scale = quantize_fp8_per_channel(torch.randn((n, k), device="cuda", generator=g) * k**-0.5)
    x = torch.randn((m, k), device="cuda", generator=g).bfloat16()
    assert scaled_mm_applies(x, weight, scale, k)
    xq, sx = quantize_fp8_groups(x, k, use_kernel=True)
    out = w8a8_linear_scaled_mm(xq, sx, weight, scale)
    ref = w8a8_linear_reference(xq, sx, k, weight, scale, 1, k, torch.bfloat16)
    ulp = 2**-6
    torch.testing.assert_close(out, ref, rtol=ulp, atol=ulp * ref.float().abs().mean().item())
