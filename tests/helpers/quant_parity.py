"""mrv2 on a quantized checkpoint against an HF reference model: greedy tokens equal, logits within tolerance."""

from __future__ import annotations

from pathlib import Path

import torch

from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams
from helpers.hf_models import hf_greedy, hf_logits, random_prompts
from helpers.quant_checkpoints import write_plain

MAX_TOKENS = 8
PROMPTS = random_prompts(2, 4, 16, seed=99)
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-5


def hf_from_plain(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """HF's Qwen3ForCausalLM read back from a plain checkpoint of `model`'s (dequantized) weights."""
    import transformers

    write_plain(model, path)
    ref = transformers.Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = None
    return ref


def mrv2_run(path: Path, **kwargs) -> tuple[list[list[int]], list[list[torch.Tensor]], LLM]:  # type: ignore[no-untyped-def]
    """Greedy tokens and the logits rows of each prompt (run one prompt at a time: row j predicts token j)."""
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, seed=0, **kwargs)
    model = llm.engine.runner.model
    rows: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        rows.extend(r.detach().clone() for r in logits)
        return logits

    model.compute_logits = recording  # type: ignore[method-assign]
    tokens, logits = [], []
    for prompt in PROMPTS:
        rows.clear()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
        tokens.append(list(out.token_ids))
        logits.append(list(rows))
    return tokens, logits, llm


def assert_matches_hf(path: Path, ref: torch.nn.Module, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    tokens, logits, llm = mrv2_run(path, **kwargs)
    for prompt, got, rows in zip(PROMPTS, tokens, logits):
        expected = hf_greedy(ref, prompt, MAX_TOKENS)
        assert got == expected
        full = hf_logits(ref, prompt + got)
        assert len(rows) == MAX_TOKENS
        for j, row in enumerate(rows):
            torch.testing.assert_close(row.float(), full[len(prompt) - 1 + j], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    return llm
