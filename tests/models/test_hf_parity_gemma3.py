"""mrv2's Gemma 3 text model (`Gemma3ForCausalLM`) against HF transformers on tiny random checkpoints.

The checkpoint has 3 layers (two with an 8-token sliding window, one full), q/k norms, sandwich norms, GELU-tanh,
tied and scaled embeddings, `query_pre_attn_scalar` 24 (not head_dim), a final logit soft-cap, and a different
RoPE per layer kind (window layers: theta 50; the full layer: theta 1000 with linear scaling x4). Prompts of
22..40 tokens (up to 5x the window), 32 output tokens, chunked prefill (8 tokens a step: chunk boundaries inside
and across the window) and preemption: greedy tokens equal HF `generate`, every logits row mrv2 computes within
atol 1e-4 / rtol 1e-5 of HF's. A `Gemma3ForConditionalGeneration` checkpoint (tiny SigLIP tower) with the same
text weights loads its text part and matches HF's. Prefix caching on gives HF's tokens with a shared prefix of 3
windows read from the cache, decode steps replayed as graphs (the fake capturer). Planted fault: the window
layers' RoPE base swapped for the full layers' breaks the logits parity.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from helpers.fake_graphs import StaticInputsCapturer
from helpers.graph_lockstep import record_replays
from helpers.hf_models import (
    TINY_GEMMA3_LAYERS,
    TINY_GEMMA3_WINDOW,
    TinySpec,
    hf_greedy,
    hf_logits,
    save_tiny_checkpoint,
)
from test_hf_parity import LOGITS_ATOL, LOGITS_RTOL, MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, SCENARIOS, run_mrv2

from framework.entrypoints.llm import LLM
from framework.models.gemma3_config import Gemma3Config
from framework.models.hf_config import UnsupportedModelError
from framework.params.sampling_params import SamplingParams

WINDOW = TINY_GEMMA3_WINDOW
TEXT = {
    **TINY_GEMMA3_LAYERS,
    "final_logit_softcapping": 30.0,
    "initializer_range": 0.05,  # tied embeddings scaled by sqrt(hidden): 0.2 makes greedy repeat one token
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    },
}
PROMPTS3 = PROMPTS[2:]  # 22, 31 and 40 tokens: 3 to 5 windows
SPEC = TinySpec("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", TEXT, seed=7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("hf-gemma3")
    return path, save_tiny_checkpoint(SPEC, path)


@pytest.fixture(scope="module")
def hf_tokens(checkpoint: tuple[Path, torch.nn.Module]) -> list[list[int]]:
    tokens = [hf_greedy(checkpoint[1], p, MAX_TOKENS) for p in PROMPTS3]
    assert min(len(set(t)) for t in tokens) >= 4, "the tiny model's continuations should vary"
    return tokens


def _check_logits(hf_model: torch.nn.Module, run, prompts: list[list[int]] = PROMPTS3) -> float:  # type: ignore[no-untyped-def]
    """The largest |logits - HF's| over every row mrv2 computed (asserting each is within tolerance)."""
    worst = 0.0
    for i, (prompt, out) in enumerate(zip(prompts, run.outputs)):
        reference = hf_logits(hf_model, prompt + out.token_ids[:-1])
        for j, seq_len, row in run.logits:
            if j == i:
                worst = max(worst, (row - reference[seq_len - 1]).abs().max().item())
                torch.testing.assert_close(row, reference[seq_len - 1], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    return worst


def test_config_reads_layer_kinds_and_refuses_attention_softcap(checkpoint) -> None:  # type: ignore[no-untyped-def]
    hf = json.loads((checkpoint[0] / "config.json").read_text())
    cfg = Gemma3Config.from_hf(hf)
    assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, WINDOW, 0]
    assert cfg.rope["rope_theta"] == 1000.0 and cfg.rope["rope_type"] == "linear"
    assert cfg.rope_local["rope_theta"] == 50.0 and cfg.query_pre_attn_scalar == 24 and cfg.tie_word_embeddings
    cfg.check_max_model_len(100_000)  # windows are served: no refusal
    old_style = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    old = Gemma3Config.from_hf({**old_style, "sliding_window_pattern": 3, "rope_local_base_freq": 50.0})
    assert old.layer_types == cfg.layer_types and old.rope_local["rope_theta"] == 50.0
    assert old.rope["rope_theta"] == 1_000_000.0  # HF's global default
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping=50"):
        Gemma3Config.from_hf({**hf, "attn_logit_softcapping": 50.0})
    with pytest.raises(UnsupportedModelError, match="hidden_activation='silu'"):
        Gemma3Config.from_hf({**hf, "hidden_activation": "silu"})


def test_greedy_and_logits_match_hf_chunked_preempt(checkpoint, hf_tokens) -> None:  # type: ignore[no-untyped-def]
    run = run_mrv2(checkpoint[0], PROMPTS3, **SCENARIOS["chunked_preempt"])
    assert [out.token_ids for out in run.outputs] == hf_tokens
    assert sum(out.num_preemptions for out in run.outputs) > 0
    assert any(seq_len < len(PROMPTS3[i]) for i, seq_len, _ in run.logits), "no prefill was chunked"
    print(f"max |logits diff|: {_check_logits(checkpoint[1], run):.2e}")


def test_multimodal_checkpoint_loads_its_text_model(checkpoint, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A Gemma3ForConditionalGeneration checkpoint (vision tower, projector, text weights under `language_model.`)
    gives HF's tokens and logits; the skipped vision tensors are logged once."""
    # HF's Gemma3ForConditionalGeneration applies no final logit soft-cap: the config leaves it out.
    text_config = {**checkpoint[1].config.to_dict(), "final_logit_softcapping": None}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.Gemma3Config(
        text_config=text_config, vision_config={**vision, "image_size": 28, "patch_size": 14}
    )
    config.mm_tokens_per_image = 4
    multimodal = transformers.Gemma3ForConditionalGeneration(config).eval()
    multimodal.model.language_model.load_state_dict(checkpoint[1].model.state_dict())
    multimodal.save_pretrained(tmp_path, safe_serialization=True)
    with caplog.at_level(logging.INFO, logger="framework.models.gemma3"):
        run = run_mrv2(tmp_path, PROMPTS[-1:])
    assert run.outputs[0].token_ids == hf_greedy(multimodal, PROMPTS[-1], MAX_TOKENS)
    _check_logits(multimodal, run, PROMPTS[-1:])
    assert sum("skipping the checkpoint's vision tower" in r.getMessage() for r in caplog.records) == 1


def test_negative_control_local_rope_base(checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With the window layers' RoPE taking the full layers' base, the logits leave HF's."""
    prompts = PROMPTS[-1:]
    run_ok = run_mrv2(checkpoint[0], prompts)
    _check_logits(checkpoint[1], run_ok, prompts)
    monkeypatch.setattr(Gemma3Config, "local_rope_inv_freq", Gemma3Config.rope_inv_freq)
    run_bad = run_mrv2(checkpoint[0], prompts)
    with pytest.raises(AssertionError):
        _check_logits(checkpoint[1], run_bad, prompts)


def test_prefix_caching_and_decode_graphs(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Prompts sharing a 24-token prefix (3 windows) through the prefix cache, decode steps replayed as graphs."""
    shared = PROMPTS[-1][:24]
    prompts = [shared + p[:6] for p in PROMPTS[:3]]
    expected = [hf_greedy(checkpoint[1], p, 12) for p in prompts]
    llm = LLM(
        str(checkpoint[0]),
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        block_size=4,
        enable_prefix_caching=True,
        max_num_seqs=2,  # fewer decode graphs to capture
    )
    llm.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
    replays = record_replays(llm)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens >= 20 for o in rest), "the shared prefix should come from the cache"
    step_graphs = llm.engine.runner.graphs.step_graphs  # full-step graphs, when on, take the decode steps
    full_step_replays = sum(g.num_replays for g in step_graphs.graphs.values()) if step_graphs else 0
    assert replays or full_step_replays, "no decode step replayed a graph"
