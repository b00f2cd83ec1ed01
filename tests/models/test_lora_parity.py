"""LoRA adapters against HF transformers + PEFT: the same tiny random base, adapters written by PEFT itself.

Four adapters (all seven projections r=8; q/v r=4 rsLoRA; o/down r=16; k/v/gate/up r=2) and the base model run
in one batch of mixed requests, under each engine setting (plain; chunked prefill; a KV cache small enough to
preempt; prefix caching), with fewer GPU adapter slots than adapters (so adapters are evicted and reloaded).
Every request's greedy tokens equal PEFT's, and the logprob of each sampled token equals PEFT's log-softmax
at that position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch
from helpers.hf_models import SPEC_BY_NAME, hf_greedy, random_prompts, save_tiny_checkpoint
from helpers.lora_adapters import ADAPTERS, hf_peft_model, save_adapter

from framework.entrypoints.llm import LLM
from framework.params.lora_request import LoRARequest
from framework.params.sampling_params import SamplingParams

SPEC = SPEC_BY_NAME["qwen3"]  # GQA, q/k norm, tied embeddings, head_dim * heads != hidden
MAX_TOKENS = 8
PROMPTS = random_prompts(2, 6, 30, seed=77)
LOGPROB_ATOL = 2e-4

SCENARIOS: dict[str, dict] = {
    "plain": {},
    # 16 tokens a step: the 30-token prompts take two chunks (and share steps with other requests' decodes).
    "chunked": {"max_num_batched_tokens": 16},
    # 12 blocks of 4 tokens hold one request of max_model_len 48: two running requests must preempt.
    "preempt": {"block_size": 4, "num_kv_blocks": 12, "max_model_len": 48},
    "prefix": {"enable_prefix_caching": True, "block_size": 4},
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, LoRARequest]]:
    root = tmp_path_factory.mktemp("lora")
    save_tiny_checkpoint(SPEC, root / "base")
    loras = {a.name: LoRARequest(a.name, str(save_adapter(SPEC, a, root / a.name))) for a in ADAPTERS}
    return root / "base", loras


@pytest.fixture(scope="module")
def reference(files) -> dict[tuple[Optional[str], int], tuple[list[int], torch.Tensor]]:  # type: ignore[no-untyped-def]
    """(adapter name or None, prompt index) -> (PEFT's greedy tokens, log-softmax of each sampled token)."""
    from helpers.hf_models import build_hf_model

    base, loras = files
    models = {None: build_hf_model(SPEC)} | {n: hf_peft_model(SPEC, Path(r.path)) for n, r in loras.items()}
    out = {}
    for name, model in models.items():
        for i, prompt in enumerate(PROMPTS):
            tokens = hf_greedy(model, prompt, MAX_TOKENS)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0].float()
            logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            out[(name, i)] = (tokens, logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0])
    return out


def test_adapters_change_the_output(reference) -> None:  # type: ignore[no-untyped-def]
    """The comparison only means something if every adapter changes the base model's greedy tokens."""
    for i in range(len(PROMPTS)):
        base = reference[(None, i)][0]
        assert all(reference[(a.name, i)][0] != base for a in ADAPTERS), "an adapter left the output unchanged"
        assert len(set(base)) >= 4


def _check(outputs, requests, reference) -> None:  # type: ignore[no-untyped-def]
    for out, (name, i) in zip(outputs, requests):
        tokens, logprobs = reference[(name, i)]
        assert out.token_ids == tokens, f"adapter {name}, prompt {i}: {out.token_ids} != PEFT {tokens}"
        got = torch.tensor([step[t].logprob for step, t in zip(out.logprobs, out.token_ids)])
        torch.testing.assert_close(got, logprobs, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_mixed_batch_matches_hf_peft(files, reference, scenario: str) -> None:  # type: ignore[no-untyped-def]
    base, loras = files
    kwargs = {"max_model_len": 96, **SCENARIOS[scenario]}
    llm = LLM(
        str(base), device="cpu", dtype="float32", seed=0, enable_lora=True, max_loras=2, max_lora_rank=16, **kwargs
    )
    names: list[Optional[str]] = [None] + [a.name for a in ADAPTERS]
    requests = [(name, i) for i in range(len(PROMPTS)) for name in names]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(
        [PROMPTS[i] for _, i in requests],
        params,
        use_tqdm=False,
        lora_request=[loras[n] if n is not None else None for n, _ in requests],
    )
    _check(outputs, requests, reference)
    slots = llm.engine.runner.lora_state.slots
    assert slots.loads > 2, "4 adapters through 2 GPU slots: adapters must have been evicted and reloaded"
    if scenario == "preempt":
        assert sum(o.num_preemptions for o in outputs) > 0, "the KV cache was meant to force preemptions"
    if scenario == "prefix":  # the same requests again: served from the cache, still each adapter's own output
        again = llm.generate(
            [PROMPTS[i] for _, i in requests],
            params,
            use_tqdm=False,
            lora_request=[loras[n] if n is not None else None for n, _ in requests],
        )
        _check(again, requests, reference)
        assert sum(o.num_cached_tokens for o in again) > 0
    assert llm.engine.is_idle()
