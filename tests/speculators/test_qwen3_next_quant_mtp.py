"""MTP heads of quantized Qwen3-Next / Qwen3.5-MoE checkpoints: the `mtp.*` layers load in the checkpoint's format.

Tiny quantized targets (`tests/helpers/gdn_quant.py`, the layout of the published FP8 releases) with a head fitted
to the target whose linear layers and experts are quantized the same way (experts one tensor set per expert):
Qwen3-Next in FP8 block (`mtp.fc` kept in 16 bits, as `modules_to_not_convert` says) and Qwen3.5-MoE in
compressed-tensors W4A16 (`mtp.fc` quantized too).

- the head's layers run the checkpoint's quantized methods, and its logits equal the hand-written formula
  (`helpers.qwen_mtp.reference_logits`) on the dequantized tensors; gate / up of the quantized experts swapped at
  load is caught (the engine-level equality below cannot see a wrong head: drafts only change speed);
- `speculator.method=mtp` keeps the greedy tokens of the run without speculation (chunked prefill), with the
  fitted first draft mostly accepted;
- a head class that reads 16-bit weights only refuses a quantized config by name; draft heads refuse tensor
  parallelism by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.gdn_quant import QWEN3_5_MOE_QUANT, QWEN3_NEXT_QUANT, quantize_mtp, write_quantized_gdn
from helpers.hf_models import random_prompts
from helpers.qwen_mtp import fitted_mtp_tensors, moe_mlp, reference_logits
from safetensors.torch import load_file, save_file

from framework.entrypoints.llm import LLM
from framework.models.loader import CheckpointError, read_hf_config
from framework.params.sampling_params import SamplingParams
from speculators.draft_heads import Qwen3NextMTPHead, load_draft_head

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = random_prompts(3, 5, 24, seed=13)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
# spec, format, 16-bit layers of the head besides the target's
CASES = {
    "qwen3_next-fp8-block": (QWEN3_NEXT_QUANT, "fp8-block", ("mtp.fc",)),
    "qwen3_5_moe-ct-w4a16": (QWEN3_5_MOE_QUANT, "ct-w4a16", ()),
}


def _llm(path: Path, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=64, seed=0, **kwargs)


@pytest.fixture(scope="module", params=list(CASES))
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, dict]:
    """A quantized checkpoint with a fitted, quantized MTP head; the greedy tokens of PROMPTS without speculation
    (the quantized target equals HF on the dequantized weights: tests/models/test_quantized_gdn_checkpoints.py);
    the head's tensors dequantized."""
    spec, fmt, keep = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = write_quantized_gdn(fmt, spec, path, keep)
    tokens = [o.token_ids for o in _llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)]
    fitted = fitted_mtp_tensors(path, model, [p + t for p, t in zip(PROMPTS, tokens)])
    stored, dequantized = quantize_mtp(fmt, fitted, keep)
    save_file(stored, str(path / "mtp.safetensors"))
    return path, tokens, dequantized


def _head_and_reference(path: Path, dequantized: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = json.loads((path / "config.json").read_text())
    base = load_file(str(path / "model.safetensors"))
    embed, lm_head = base["model.embed_tokens.weight"], base["lm_head.weight"]
    head = load_draft_head(path, "mtp", read_hf_config(path))
    block = head.mtp.layers[0]
    assert block.self_attn.q_proj.quant_method is not None and block.mlp.experts.quant_method is not None
    assert block.mlp.shared_expert.down_proj.quant_method is not None
    assert (head.mtp.fc.quant_method is None) == ("fp8" in cfg["quantization_config"]["quant_method"])
    head.share_target_weights(embed, lm_head)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg["vocab_size"], (9,), generator=gen)
    hidden = torch.randn(9, cfg["hidden_size"], generator=gen)
    with torch.no_grad():
        ours = head.compute_logits(head(ids[None], hidden[None]))[0]
    return ours, reference_logits(dequantized, cfg, embed, lm_head, ids, hidden, mlp=moe_mlp)


def test_quantized_head_logits_match_the_formula(target: tuple[Path, list, dict]) -> None:
    ours, ref = _head_and_reference(target[0], target[2])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_planted_quantized_gate_up_swap_is_caught(
    target: tuple[Path, list, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every quantized expert tensor of `gate_proj` (weight, scales) stacked into the up slot and vice versa."""
    original = Qwen3NextMTPHead.stacked_tensor_part

    def swapped(self, name):  # type: ignore[no-untyped-def]
        part = original(self, name)
        if part is None or len(part.index) != 2:
            return part
        return part._replace(index=(part.index[0], 1 - part.index[1]))

    monkeypatch.setattr(Qwen3NextMTPHead, "stacked_tensor_part", swapped)
    ours, ref = _head_and_reference(target[0], target[2])
    assert not torch.allclose(ours, ref, atol=1e-3, rtol=1e-3)


def test_quantized_mtp_speculation_keeps_greedy_tokens(target: tuple[Path, list, dict]) -> None:
    path, want, _ = target
    llm = _llm(path, speculative_config=MTP, max_num_batched_tokens=7)  # prompts cut into chunks
    head = llm.engine.runner.speculator.head
    assert head.mtp.layers[0].mlp.experts.quant_method is not None
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.spec_metrics
    print(f"quantized MTP acceptance ({path.name}): {stats.as_dict()}")
    assert stats.num_drafts > 0 and stats.per_position_acceptance[0] > 0.9  # the fitted first draft


def test_head_without_quantized_layers_refuses_a_quantized_config(
    target: tuple[Path, list, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Qwen3NextMTPHead, "supports_quantization", False)
    with pytest.raises(CheckpointError, match=r"declares quantized weights \((fp8|compressed-tensors)\), which the "):
        load_draft_head(target[0], "mtp", read_hf_config(target[0]))


def test_draft_heads_refuse_tensor_parallelism() -> None:
    """A rank holds a slice of the embedding and LM head the head borrows: refused by name, before loading."""
    from types import SimpleNamespace

    from framework.config.schema import SpeculatorConfig
    from framework.layers.parallel.context import ParallelContext
    from speculators.eagle import MTPSpeculator

    loaded = SimpleNamespace(parallel=ParallelContext(tp_size=2, rank=0))
    config = SpeculatorConfig(**MTP)
    with pytest.raises(CheckpointError, match="draft heads do not run under tensor or pipeline parallelism"):
        MTPSpeculator(config, loaded, 4, torch.device("cpu"))  # type: ignore[arg-type]
