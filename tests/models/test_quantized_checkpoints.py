"""Quantized checkpoints against HF transformers running the same model with the weights dequantized.

Each format's tiny checkpoint (tests/helpers/quant_checkpoints.py: the tensor names, dtypes, shapes and config keys
of public releases) runs in mrv2 on the CPU in float32; the reference is HF's `Qwen3ForCausalLM` loaded from a
plain checkpoint holding the dequantized weights. mrv2's CPU path multiplies by the same dequantized weights, so
greedy tokens are equal and logits agree to float32 summation order (the parity tests' tolerance). Online FP8
(`model.quantization=fp8`) is compared the same way against a per-channel quantize-dequantize of the weights done
here, independently of mrv2's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hf_models import hf_greedy, random_prompts
from helpers.quant_checkpoints import FP8_MAX, QUANT_SPEC, write_plain, write_quantized
from helpers.quant_parity import LOGITS_ATOL, LOGITS_RTOL, MAX_TOKENS, PROMPTS
from helpers.quant_parity import assert_matches_hf as _assert_matches_hf
from helpers.quant_parity import hf_from_plain as _hf_from_plain
from helpers.quant_parity import mrv2_run as _mrv2_run

from framework.entrypoints.llm import LLM
from framework.layers.quantization import is_quantized
from framework.params.sampling_params import SamplingParams


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel", "ct-tensor", "gptq", "gptq-act-asym", "awq", "ct-w4a16"])
def test_quantized_checkpoint_matches_hf_dequantized(fmt: str, tmp_path: Path) -> None:
    hf_model = write_quantized(fmt, tmp_path / "quant")
    ref = _hf_from_plain(hf_model, tmp_path / "plain")
    llm = _assert_matches_hf(tmp_path / "quant", ref)
    model = llm.engine.runner.model
    q_proj = model.model.layers[0].self_attn.q_proj
    assert is_quantized(q_proj)
    fp8 = "weight" in q_proj._parameters
    assert q_proj.weight.dtype == torch.float8_e4m3fn if fp8 else q_proj.qweight.dtype == torch.int32
    assert not is_quantized(model.model.layers[0].mlp) and model.lm_head.weight.dtype == torch.float32


def test_modules_to_not_convert_stay_16_bit(tmp_path: Path) -> None:
    """Layers the config keeps unquantized (here every o_proj) load their plain weights and run unquantized."""
    hf_model = write_quantized("fp8-block", tmp_path / "quant", keep=("o_proj",))
    ref = _hf_from_plain(hf_model, tmp_path / "plain")
    llm = _assert_matches_hf(tmp_path / "quant", ref)
    attn = llm.engine.runner.model.model.layers[1].self_attn
    assert not is_quantized(attn.o_proj) and attn.o_proj.weight.dtype == torch.float32
    assert is_quantized(attn.k_proj)


def _quant_dequant_rows(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel FP8 e4m3 round trip (the reference for online FP8), written independently of mrv2's."""
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def test_online_fp8_matches_hf_on_quantized_weights(tmp_path: Path) -> None:
    from helpers.hf_models import build_hf_model

    plain = build_hf_model(QUANT_SPEC)
    write_plain(plain, tmp_path / "bf16")
    with torch.no_grad():
        for name, param in plain.named_parameters():
            if name.endswith("proj.weight"):
                param.copy_(_quant_dequant_rows(param.float()))
    ref = _hf_from_plain(plain, tmp_path / "ref")
    llm = _assert_matches_hf(tmp_path / "bf16", ref, quantization="fp8")
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.float8_e4m3fn and down.weight_scale.shape == (
        QUANT_SPEC.config_kwargs["hidden_size"],
        1,
    )


def test_online_fp8_differs_from_16_bit(tmp_path: Path) -> None:
    """Negative control for the test above: the FP8 round trip changes the logits by more than the tolerance, so
    a run that silently skipped quantization (or a reference that did) would fail it."""
    from helpers.hf_models import build_hf_model

    plain = build_hf_model(QUANT_SPEC)
    write_plain(plain, tmp_path / "bf16")
    _, quantized, _ = _mrv2_run(tmp_path / "bf16", quantization="fp8")
    _, full, _ = _mrv2_run(tmp_path / "bf16")
    assert not torch.allclose(quantized[0][0], full[0][0], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_preemption_and_chunked_prefill_keep_hf_tokens(tmp_path: Path) -> None:
    """All prompts at once with a KV cache too small for them (preemption, recomputed prefills) and an 8-token step
    budget (chunked prefills mixed with decodes): the FP8 model still gives HF's greedy tokens."""
    hf_model = write_quantized("fp8-block", tmp_path / "quant")
    ref = _hf_from_plain(hf_model, tmp_path / "plain")
    prompts = random_prompts(4, 6, 20, seed=3)
    llm = LLM(
        str(tmp_path / "quant"),
        device="cpu",
        dtype="float32",
        max_model_len=32,
        seed=0,
        block_size=4,
        num_kv_blocks=10,
        max_num_batched_tokens=8,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert sum(out.num_preemptions for out in outs) > 0
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(ref, prompt, MAX_TOKENS)


@pytest.mark.parametrize("fmt", ["fp8-block", "gptq-act-asym"])
def test_engine_with_the_triton_kernels_gives_hf_tokens(fmt: str, tmp_path: Path) -> None:
    """`kernels.backend=triton` (the interpreter here): the W8A16 / W4A16 kernels inside the engine, act-order
    permutation included, give HF's greedy tokens on the dequantized model."""
    ref = write_quantized(fmt, tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, kernel_backend="triton")
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert list(out.token_ids) == hf_greedy(ref, prompt, 6)


def test_a_layer_kept_16_bit_is_merged_and_takes_the_small_batch_path(tmp_path: Path) -> None:
    """A whole decoder layer in `modules_to_not_convert` gets its merged q/k/v and gate/up weights (and so the
    small-batch GEMV path), while the quantized layers keep separate projections on the default path."""
    from framework.models.small_batch import enable_small_batch

    write_quantized("fp8-block", tmp_path, keep=("model.layers.0.",))
    model = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64).engine.runner.model
    plain, quantized = model.model.layers
    assert plain.self_attn.qkv_weight is not None and quantized.self_attn.qkv_weight is None
    assert enable_small_batch(model, 1) == 1
    assert plain.small_batch_max_tokens == 1 and quantized.small_batch_max_tokens == 0


def test_fp8_activation_threshold_switches_the_path(tmp_path: Path) -> None:
    """`model.fp8_activation_min_tokens` reaches every FP8 layer; with the kernels (interpreted here) a 2-token
    threshold sends the prefill through the W8A8 GEMM, whose logits move away from the dequantized model's, and
    null keeps W8A16, whose logits equal the reference's (the GPU test checks the same with CUDA graphs)."""
    write_quantized("fp8-block", tmp_path)
    prompt = PROMPTS[0]

    def first_logprobs(threshold: int | None) -> tuple[LLM, list[float]]:
        llm = LLM(
            str(tmp_path),
            device="cpu",
            dtype="float32",
            max_model_len=64,
            kernel_backend="triton",
            fp8_activation_min_tokens=threshold,
        )
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
        return llm, sorted(e.logprob for e in out.logprobs[0].values())

    weight_only, exact = first_logprobs(None)
    q_proj = weight_only.engine.runner.model.model.layers[0].self_attn.q_proj
    assert q_proj.quant_method.w8a8_min_tokens is None
    quantized, moved = first_logprobs(2)
    assert quantized.engine.runner.model.model.layers[0].self_attn.q_proj.quant_method.w8a8_min_tokens == 2
    _, reference = first_logprobs(10_000)
    assert exact == pytest.approx(reference, abs=1e-5)  # 10,000 tokens: never reached, as null
    assert max(abs(a - b) for a, b in zip(exact, moved)) > 1e-4
