"""Online FP8 (`model.quantization=fp8`) reaches the Qwen3-Next MTP head: its 16-bit `mtp.*` tensors load, then its
linear layers (fc, attention, shared expert) and its experts become FP8 with one scale per output channel, as the
target's do; the router and the shared expert's gate stay 16-bit (plain `nn.Linear`, as in the target).

- the head's layers hold e4m3 weights and [N, 1] scales, and its logits equal the hand-written formula
  (`helpers.qwen_mtp.reference_logits`) on weights quantized and dequantized per channel here; a head loaded
  without the online format (the planted fault: `load_draft_head` not handed it) misses that reference;
- a head class that reads 16-bit weights only (EAGLE) stays 16-bit rather than being refused;
- `speculator.method=mtp` under online FP8 keeps the greedy tokens of the FP8 run without speculation, with the
  engine's head in FP8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.gdn_models import QWEN3_NEXT, slow_decay_checkpoint
from helpers.hf_models import random_prompts
from helpers.qwen_mtp import checkpoint_layout, fitted_mtp_tensors, moe_mlp, reference_logits
from safetensors.torch import load_file, save_file

from framework.entrypoints.llm import LLM
from framework.models.loader import read_hf_config
from framework.params.sampling_params import SamplingParams
from speculators.draft_heads import load_draft_head

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = random_prompts(3, 5, 24, seed=14)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
E4M3_MAX = 448.0
# The head's projections the online method quantizes (not norms, the router `mlp.gate`, `shared_expert_gate`).
QUANTIZED = ("mtp.fc.weight", "_proj.weight")


def _llm(path: Path, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=64, seed=0, quantization="fp8", **kwargs)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A 16-bit Qwen3-Next checkpoint with a fitted MoE MTP head (experts one tensor per expert), and the greedy
    tokens of PROMPTS under online FP8 without speculation."""
    path = tmp_path_factory.mktemp("qwen3_next-online-fp8-mtp")
    model = slow_decay_checkpoint(QWEN3_NEXT, path)
    tokens = [o.token_ids for o in _llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)]
    tensors = fitted_mtp_tensors(path, model, [p + t for p, t in zip(PROMPTS, tokens)])
    save_file(checkpoint_layout(tensors, fused=False), str(path / "mtp.safetensors"))
    return path, tokens


def _per_channel_qdq(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> the float32 weight an e4m3 copy with one scale per row (row max -> 448) stands for."""
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (w.float() / scale).to(torch.float8_e4m3fn).float() * scale


def _head_logits(path: Path, quantization: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
    """(the head's logits, the formula's on per-channel FP8 weights, the head) for random ids and hidden states."""
    cfg = json.loads((path / "config.json").read_text())
    base, stored = load_file(str(path / "model.safetensors")), load_file(str(path / "mtp.safetensors"))
    embed, lm_head = base["model.embed_tokens.weight"], base["lm_head.weight"]
    fp8 = {n: _per_channel_qdq(t) if n.endswith(QUANTIZED) else t for n, t in stored.items()}
    head = load_draft_head(path, "mtp", read_hf_config(path), quantization=quantization)
    head.share_target_weights(embed, lm_head)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg["vocab_size"], (9,), generator=gen)
    hidden = torch.randn(9, cfg["hidden_size"], generator=gen)
    with torch.no_grad():
        ours = head.compute_logits(head(ids[None], hidden[None]))[0]
    return ours, reference_logits(fp8, cfg, embed, lm_head, ids, hidden, mlp=moe_mlp), head


def test_online_fp8_head_layers_are_fp8_per_channel(target: tuple[Path, list[list[int]]]) -> None:
    _, _, head = _head_logits(target[0], "fp8")
    block = head.mtp.layers[0]
    attn, moe = block.self_attn, block.mlp
    linears = [head.mtp.fc, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *moe.shared_expert.children()]
    for layer in linears:
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert tuple(layer.weight_scale.shape) == (layer.weight.shape[0], 1)
    for proj in ("gate_up_proj", "down_proj"):
        weight = getattr(moe.experts, proj)
        assert weight.dtype == torch.float8_e4m3fn
        assert tuple(getattr(moe.experts, f"{proj}_weight_scale").shape) == (*weight.shape[:-1], 1)
    assert moe.gate.weight.dtype == torch.float32 and moe.shared_expert_gate.weight.dtype == torch.float32


def test_online_fp8_head_logits_match_the_per_channel_formula(target: tuple[Path, list[list[int]]]) -> None:
    ours, ref, _ = _head_logits(target[0], "fp8")
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_planted_head_left_in_16_bits_misses_the_formula(target: tuple[Path, list[list[int]]]) -> None:
    ours, ref, _ = _head_logits(target[0], None)
    assert not torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_online_fp8_mtp_speculation_keeps_greedy_tokens(target: tuple[Path, list[list[int]]]) -> None:
    path, want = target
    llm = _llm(path, speculative_config=MTP, max_num_batched_tokens=7)  # prompts cut into chunks
    head = llm.engine.runner.speculator.head
    assert head.mtp.fc.weight.dtype == torch.float8_e4m3fn
    assert head.mtp.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.spec_metrics
    print(f"online FP8 MTP acceptance: {stats.as_dict()}")
    assert stats.num_drafts > 0 and stats.per_position_acceptance[0] > 0.5  # the fitted first draft


def test_head_reading_16_bit_weights_only_stays_16_bit_under_online_fp8(
    target: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A declared quantized format is refused for such a head; the target's online one leaves it as it is."""
    from speculators.draft_heads import Qwen3NextMTPHead

    monkeypatch.setattr(Qwen3NextMTPHead, "supports_quantization", False)
    head = load_draft_head(target[0], "mtp", read_hf_config(target[0]), quantization="fp8")
    assert head.mtp.fc.quant_method is None and head.mtp.fc.weight.dtype == torch.float32
