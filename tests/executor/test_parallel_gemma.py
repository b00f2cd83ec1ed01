"""Gemma 3 and Gemma 4 under tensor parallelism, two CPU processes (gloo), against one process and HF transformers.

The tiny checkpoints of the HF parity tests (8-token windows, a final logit soft-cap, tied embeddings scaled by
sqrt(hidden)): Gemma 3's (two window layers, one full); Gemma 4's "ple" (KV-shared layers, per-layer inputs, full
layers of their own head_dim: a rank's KV rows are `kv_row_width(2)`), with KV groups on; and Gemma 4's "moe"
(`attention_k_eq_v` full layers with two KV heads, so they split, and a 4-expert MoE whose intermediate dims split);
and Gemma 3's quantized to FP8 with per-channel scales (compressed-tensors, the quantized-llama tests' writer; HF
runs the dequantized weights).
Prompts of 12..30 tokens (1.5 to 4 windows), 8-token chunks, 4-token blocks. Claims: with two tensor ranks each rank
holds half the heads (of each layer kind), greedy tokens equal one process and HF `generate`, and every prompt
logprob is within 1e-4 of the one-process run's and of HF's. Planted in the worker rank alone: its token embedding
skips Gemma's sqrt(hidden) scale; the outputs then leave the one-process run's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import pytest
import torch
from helpers.hf_models import TinySpec, hf_greedy, hf_logits, random_prompts
from helpers.quant_checkpoints import write_quantized
from helpers.tp_faults import plant_in_workers
from test_hf_parity_gemma3 import SPEC as GEMMA3
from test_hf_parity_gemma4 import SPECS as GEMMA4
from test_hf_parity_gemma4 import save_gemma4_checkpoint
from test_parallel import _shutdown

from framework.engine.request import RequestOutput
from framework.entrypoints.llm import LLM
from framework.entrypoints.llm_config import config_from_kwargs
from framework.layers.quantization import is_quantized
from framework.params.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # spawns processes

PROMPTS = random_prompts(3, 12, 30, seed=2626)
MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1)
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 8}
LOGPROB_ATOL = 1e-4
MOE_TP = dataclasses.replace(
    GEMMA4["moe"], config_kwargs={**GEMMA4["moe"].config_kwargs, "num_global_key_value_heads": 2}
)
# spec, KV groups on, (heads, KV heads) a rank holds in layer 0 (window) and layer 2 (full), quantization format
CASES = {
    "gemma3": (GEMMA3, False, ((2, 1), (2, 1)), None),
    "gemma3-fp8": (GEMMA3, True, ((2, 1), (2, 1)), "ct-channel"),
    "gemma4-ple": (GEMMA4["ple"], True, ((2, 1), (2, 1)), None),
    "gemma4-moe": (MOE_TP, True, ((2, 1), (2, 1)), None),
}


def _save(spec: TinySpec, path: Path, fmt: Optional[str]) -> torch.nn.Module:
    """The checkpoint of `spec` under `path` (in quantization format `fmt`), and the HF model it means."""
    if fmt is not None:
        return write_quantized(fmt, path, spec)
    if spec.architecture.startswith("Gemma4"):
        return save_gemma4_checkpoint(spec, path)
    from helpers.hf_models import save_tiny_checkpoint

    return save_tiny_checkpoint(spec, path)


def _llm(path: Path, tp: int, kv_groups: bool) -> LLM:
    config = config_from_kwargs(str(path), {**ENGINE, "tensor_parallel_size": tp, "seed": 0})
    return LLM(config=config.model_copy(update={"cache": config.cache.model_copy(update={"kv_groups": kv_groups})}))


def _prompt_logprobs(outs: list[RequestOutput]) -> list[torch.Tensor]:
    """Each prompt's logprobs of its own tokens (positions 1..)."""
    return [
        torch.tensor([o.prompt_logprobs[i][t].logprob for i, t in enumerate(p) if i])  # type: ignore[index]
        for o, p in zip(outs, PROMPTS)
    ]


def _hf_prompt_logprobs(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for p in PROMPTS:
        logprobs = torch.log_softmax(hf_logits(model, p).float(), dim=-1)  # [len, vocab]
        out.append(logprobs[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0])
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(checkpoint, KV groups, heads per rank, quantization format, HF's tokens, HF's prompt logprobs, the
    one-process run's tokens and prompt logprobs)."""
    spec, kv_groups, heads, fmt = CASES[request.param]
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    hf_model = _save(spec, path, fmt)
    hf_tokens = [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    assert min(len(set(t)) for t in hf_tokens) >= 3, "the tiny model's continuations should vary"
    llm = _llm(path, 1, kv_groups)
    try:
        single = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [list(o.token_ids) for o in single]
    return path, kv_groups, heads, fmt, hf_tokens, _hf_prompt_logprobs(hf_model), tokens, _prompt_logprobs(single)


def _check(outs: list[RequestOutput], want_tokens: list[list[int]], want_logprobs: list[torch.Tensor]) -> float:
    """Tokens equal and prompt logprobs within `LOGPROB_ATOL`; returns the largest logprob difference."""
    assert [list(o.token_ids) for o in outs] == want_tokens
    worst = max((a - b).abs().max().item() for a, b in zip(_prompt_logprobs(outs), want_logprobs))
    assert worst <= LOGPROB_ATOL, f"prompt logprobs differ by up to {worst:.2e}"
    return worst


def test_tensor_parallel_2_matches_one_process_and_hf(case) -> None:  # type: ignore[no-untyped-def]
    path, kv_groups, heads, fmt, hf_tokens, hf_logprobs, tokens, logprobs = case
    assert tokens == hf_tokens
    print(f"one process vs HF: {_check_single(tokens, logprobs, hf_tokens, hf_logprobs):.2e}")
    llm = _llm(path, 2, kv_groups)
    try:
        runner = llm.engine.runner
        layers = runner.model.model.layers
        got = tuple((layers[i].self_attn.num_heads, layers[i].self_attn.num_kv_heads) for i in (0, 2))
        assert got == heads, "the driver should hold half the heads of each layer kind"
        assert is_quantized(layers[2].mlp.down_proj) == (fmt is not None)
        assert (runner.kv_groups is not None) == kv_groups
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        print(f"tp=2 vs one process: {_check(outs, tokens, logprobs):.2e}")
        print(f"tp=2 vs HF: {_check(outs, hf_tokens, hf_logprobs):.2e}")
    finally:
        _shutdown(llm)


def _check_single(tokens, logprobs, hf_tokens, hf_logprobs) -> float:  # type: ignore[no-untyped-def]
    assert tokens == hf_tokens
    worst = max((a - b).abs().max().item() for a, b in zip(logprobs, hf_logprobs))
    assert worst <= LOGPROB_ATOL
    return worst


def test_a_worker_skipping_the_embedding_scale_breaks_the_match(case, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path, kv_groups, _, _, _, _, tokens, logprobs = case
    plant_in_workers(monkeypatch, "gemma_embedding_unscaled")
    llm = _llm(path, 2, kv_groups)
    try:
        with pytest.raises(AssertionError):
            _check(llm.generate(PROMPTS, PARAMS, use_tqdm=False), tokens, logprobs)
    finally:
        _shutdown(llm)


def test_multimodal_checkpoint_ranks_hold_the_text_checkpoints_slices(tmp_path: Path) -> None:
    """A `Gemma3ForConditionalGeneration` checkpoint (text weights under `language_model.`, placed by
    `stacked_tensor_part`) gives each tensor rank exactly the parameters the text-only checkpoint gives it (the
    gloo test above checks those), in one process. Planted once, the text tensors read whole on every rank (no
    shard) failed it."""
    import transformers
    from helpers.hf_models import build_hf_model
    from helpers.quant_tp import load_model

    from framework.layers.parallel.context import ParallelContext

    text = build_hf_model(GEMMA3)
    text.save_pretrained(tmp_path / "text", safe_serialization=True)
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.Gemma3Config(
        text_config={**text.config.to_dict(), "final_logit_softcapping": None},
        vision_config={**vision, "image_size": 28, "patch_size": 14},
    )
    config.mm_tokens_per_image = 4
    multimodal = transformers.Gemma3ForConditionalGeneration(config).eval()
    multimodal.model.language_model.load_state_dict(text.model.state_dict())
    multimodal.save_pretrained(tmp_path / "mm", safe_serialization=True)
    for rank in range(2):
        ctx = ParallelContext(tp_size=2, rank=rank)
        want = dict(load_model(tmp_path / "text", ctx).named_parameters())
        got = dict(load_model(tmp_path / "mm", ctx).named_parameters())
        assert want.keys() == got.keys()
        for name, param in got.items():
            assert torch.equal(param, want[name]), name
