"""mrv2's gpt-oss (`GptOssForCausalLM`) against HF transformers on a tiny random checkpoint.

The checkpoint has 4 layers alternating an 8-token sliding window and full attention, learned sinks, 4 experts
top-2 with biases and the clamped SwiGLU, YaRN RoPE; prompts of 5..40 tokens (up to 5x the window) and 32 output
tokens. As `test_hf_parity` for the dense families: greedy tokens equal HF `generate` token for token, every
logits row mrv2 computes within atol 1e-4 / rtol 1e-5 of HF's at the same position, plain and with chunked
prefill (8 tokens a step: chunk boundaries inside and across the window) + preemption; prefix caching on gives
the same tokens with the shared prefix read from the cache; decode graphs (the fake capturer) give HF's tokens.
A planted fault (the window ignored) must break the logits parity.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.fake_graphs import StaticInputsCapturer
from helpers.graph_lockstep import record_replays
from helpers.hf_models import TinySpec, hf_greedy, hf_logits
from helpers.mxfp4_checkpoints import build_gpt_oss
from test_hf_parity import LOGITS_ATOL, LOGITS_RTOL, MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, SCENARIOS, run_mrv2

from framework.entrypoints.llm import LLM
from framework.models.gpt_oss import GptOssForCausalLM
from framework.models.gpt_oss_config import GptOssConfig
from framework.models.hf_config import UnsupportedModelError
from framework.params.sampling_params import SamplingParams

WINDOW = 8
SPEC = TinySpec(
    "gpt-oss",
    "GptOssForCausalLM",
    "GptOssConfig",
    {
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "sliding_window": WINDOW,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    },
    seed=21,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("hf-gpt-oss")
    model = build_gpt_oss(SPEC)  # the experts' biases randomised too
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def hf_tokens(checkpoint: tuple[Path, torch.nn.Module]) -> list[list[int]]:
    tokens = [hf_greedy(checkpoint[1], p, MAX_TOKENS) for p in PROMPTS]
    assert min(len(set(t)) for t in tokens) >= 4, "the tiny model's continuations should vary"
    return tokens


def _check_logits(hf_model: torch.nn.Module, run, prompts: list[list[int]] = PROMPTS) -> float:  # type: ignore[no-untyped-def]
    """The largest |logits - HF's| over every row mrv2 computed (asserting each is within tolerance)."""
    worst = 0.0
    for i, (prompt, out) in enumerate(zip(prompts, run.outputs)):
        reference = hf_logits(hf_model, prompt + out.token_ids[:-1])
        for j, seq_len, row in run.logits:
            if j == i:
                worst = max(worst, (row - reference[seq_len - 1]).abs().max().item())
                torch.testing.assert_close(row, reference[seq_len - 1], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    return worst


def test_config_reads_layer_kinds_and_refuses_other_quantization(checkpoint) -> None:  # type: ignore[no-untyped-def]
    cfg = GptOssConfig.from_hf(checkpoint[1].config.to_dict() | {"architectures": ["GptOssForCausalLM"]})
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, 0, WINDOW, 0]
    cfg.check_max_model_len(100_000)  # windows are served: no refusal
    with pytest.raises(UnsupportedModelError, match="quant_method='fp8': gpt-oss reads bf16 checkpoints and MXFP4"):
        GptOssConfig.from_hf({**checkpoint[1].config.to_dict(), "quantization_config": {"quant_method": "fp8"}})


@pytest.mark.parametrize("scenario", ["plain", "chunked_preempt"])
def test_greedy_and_logits_match_hf(checkpoint, hf_tokens, scenario: str) -> None:  # type: ignore[no-untyped-def]
    run = run_mrv2(checkpoint[0], PROMPTS, **SCENARIOS[scenario])
    assert [out.token_ids for out in run.outputs] == hf_tokens
    if scenario == "chunked_preempt":
        assert sum(out.num_preemptions for out in run.outputs) > 0
        assert any(seq_len < len(PROMPTS[i]) for i, seq_len, _ in run.logits), "no prefill was chunked"
    print(f"max |logits diff| {scenario}: {_check_logits(checkpoint[1], run):.2e}")


def test_prefix_caching_and_decode_graphs(checkpoint, hf_tokens) -> None:  # type: ignore[no-untyped-def]
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


def test_negative_control_window_ignored(checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With every layer's window dropped (full attention everywhere) the logits leave HF's."""
    run_ok = run_mrv2(checkpoint[0], PROMPTS[-1:])
    real_init = GptOssForCausalLM.__init__

    def full_everywhere(self, cfg, ctx=None):  # type: ignore[no-untyped-def]
        real_init(self, cfg) if ctx is None else real_init(self, cfg, ctx)
        for layer in self.model.layers:
            layer.window = 0

    monkeypatch.setattr(GptOssForCausalLM, "__init__", full_everywhere)
    run_bad = run_mrv2(checkpoint[0], PROMPTS[-1:])
    _check_logits(checkpoint[1], run_ok, PROMPTS[-1:])
    with pytest.raises(AssertionError):
        _check_logits(checkpoint[1], run_bad, PROMPTS[-1:])
