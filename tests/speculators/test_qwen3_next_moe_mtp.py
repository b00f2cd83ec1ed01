"""MTP heads whose block has the target's sparse MoE MLP: Qwen3-Next (experts stored one tensor per expert) and
Qwen3.5-MoE (experts stored fused, `experts.gate_up_proj [E, 2I, H]`), on tiny random checkpoints.

- the head's logits equal a hand-written PyTorch version of the formula that reads the checkpoint's tensors in
  their stored layout (softmax router, top-k renormalised, SiLU experts, the shared expert scaled by its sigmoid
  gate); the reference catches a shared expert without its gate and gate / up rows swapped at load time (planted
  faults the engine-level equality cannot see: drafts only change speed);
- paged drafting through the draft-graph buffers equals the head's full-sequence forward;
- `speculator.method=mtp` with a head fitted to the target: greedy tokens equal the run without speculation
  (chunked prefill, mixed prompt lengths) and the acceptance stats are reported;
- a checkpoint missing one expert's tensor is refused, naming the stacked parameter it leaves incomplete; a
  misshapen expert tensor (per expert or fused) is refused, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.gdn_models import QWEN3_5_MOE, QWEN3_NEXT, slow_decay_checkpoint
from helpers.hf_models import random_prompts
from helpers.qwen_mtp import checkpoint_layout, fitted_mtp_tensors, moe_mlp, random_mtp_tensors, reference_logits
from safetensors.torch import load_file, save_file

from framework.entrypoints.llm import LLM
from framework.models.loader import CheckpointError, read_hf_config
from framework.models.qwen3_next import SparseMoe
from framework.params.sampling_params import SamplingParams
from speculators.draft_heads import Qwen3NextMTPHead, load_draft_head

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = random_prompts(3, 5, 24, seed=12)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
# spec, whether its checkpoint stores the experts fused
CASES = {"qwen3_next": (QWEN3_NEXT, False), "qwen3_5_moe": (QWEN3_5_MOE, True)}


def _llm(path: Path, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=64, seed=0, **kwargs)


@pytest.fixture(scope="module", params=list(CASES))
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, bool]:
    """A MoE hybrid checkpoint with a fitted MoE MTP head in its stored layout, the greedy tokens of PROMPTS
    without speculation (equal to HF's: tests/model_states/test_gdn_hybrid.py), and whether experts are fused."""
    spec, fused = CASES[request.param]
    path = tmp_path_factory.mktemp(f"{spec.name}-mtp")
    model = slow_decay_checkpoint(spec, path)
    tokens = [o.token_ids for o in _llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)]
    tensors = fitted_mtp_tensors(path, model, [p + t for p, t in zip(PROMPTS, tokens)])
    save_file(checkpoint_layout(tensors, fused), str(path / "mtp.safetensors"))
    return path, tokens, fused


@pytest.fixture(scope="module")
def random_head(target: tuple[Path, list, bool], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's config and a random MoE MTP head (every norm weight nonzero) in the target's layout."""
    path = tmp_path_factory.mktemp("moe-mtp-random")
    (path / "config.json").write_text((target[0] / "config.json").read_text())
    save_file(checkpoint_layout(random_mtp_tensors(path, seed=0), target[2]), str(path / "mtp.safetensors"))
    return path


# ---- the head against a hand-written reference ----------------------------------------------------------------
def _head_and_reference(head_dir: Path, target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = json.loads((head_dir / "config.json").read_text())
    tensors, base = load_file(str(head_dir / "mtp.safetensors")), load_file(str(target_dir / "model.safetensors"))
    embed, lm_head = base["model.embed_tokens.weight"], base["lm_head.weight"]
    head = load_draft_head(head_dir, "mtp", read_hf_config(target_dir))
    assert isinstance(head, Qwen3NextMTPHead) and isinstance(head.mtp.layers[0].mlp, SparseMoe)
    head.share_target_weights(embed, lm_head)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg["vocab_size"], (9,), generator=gen)
    hidden = torch.randn(9, cfg["hidden_size"], generator=gen)
    with torch.no_grad():
        ours = head.compute_logits(head(ids[None], hidden[None]))[0]
    return ours, reference_logits(tensors, cfg, embed, lm_head, ids, hidden, mlp=moe_mlp)


def test_moe_head_logits_match_the_formula(target: tuple[Path, list, bool], random_head: Path) -> None:
    ours, ref = _head_and_reference(random_head, target[0])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_planted_shared_expert_without_gate_is_caught(
    target: tuple[Path, list, bool], random_head: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = SparseMoe.forward

    def ungated(self, x):  # type: ignore[no-untyped-def]
        gated = original(self, x)  # routed + sigmoid(gate(x)) * shared: take the gate away again
        shared = self.shared_expert(x)
        return gated - torch.sigmoid(self.shared_expert_gate(x)) * shared + shared

    monkeypatch.setattr(SparseMoe, "forward", ungated)
    ours, ref = _head_and_reference(random_head, target[0])
    assert not torch.allclose(ours, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("target", ["qwen3_next"], indirect=True)  # the per-expert layout (fused: one read)
def test_planted_gate_up_swap_at_load_is_caught(
    target: tuple[Path, list, bool], random_head: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A per-expert `gate_proj` stacked into the up slot and `up_proj` into the gate slot."""
    assert not target[2]
    original = Qwen3NextMTPHead.stacked_tensor_part

    def swapped(self, name):  # type: ignore[no-untyped-def]
        part = original(self, name)
        if part is None or len(part.index) != 2:
            return part
        return part._replace(index=(part.index[0], 1 - part.index[1]))

    monkeypatch.setattr(Qwen3NextMTPHead, "stacked_tensor_part", swapped)
    ours, ref = _head_and_reference(random_head, target[0])
    assert not torch.allclose(ours, ref, atol=1e-3, rtol=1e-3)


def test_paged_moe_drafting_with_graph_buffers_equals_full_sequence(target: tuple[Path, list, bool],
                                                                    random_head: Path) -> None:  # fmt: skip
    """The MoE head on the paged KV through `HeadDrafter` and the draft-graph buffers (replayed eagerly on the
    CPU: padding rows included) drafts what its full-sequence forward predicts (tests/speculators/
    test_head_drafter.py's fake target: chunked prefills, every acceptance count, a preemption)."""
    from test_head_drafter import FakeTargetRun, run_scenario

    head = load_draft_head(random_head, "mtp", read_hf_config(target[0]))
    gen = torch.Generator().manual_seed(4)
    head.share_target_weights(*torch.randn(2, head.vocab_size, head.hidden_size, generator=gen))
    run_scenario(FakeTargetRun(head, seed=11, graph_sizes=(2, 4)))


# ---- the engine -----------------------------------------------------------------------------------------------
def test_moe_mtp_speculation_keeps_greedy_tokens(target: tuple[Path, list, bool]) -> None:
    path, want, _ = target
    llm = _llm(path, speculative_config=MTP, max_num_batched_tokens=7)  # prompts cut into chunks
    assert isinstance(llm.engine.runner.speculator.head.mtp.layers[0].mlp, SparseMoe)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.spec_metrics
    print(f"MoE MTP acceptance ({path.name}): {stats.as_dict()}")
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some kept, some not
    assert stats.per_position_acceptance[0] > 0.9  # the fitted first draft


def test_missing_expert_tensor_is_refused(target: tuple[Path, list, bool], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((target[0] / "config.json").read_text())
    tensors = load_file(str(target[0] / "mtp.safetensors"))
    gone = "mtp.layers.0.mlp.experts.gate_up_proj" if target[2] else "mtp.layers.0.mlp.experts.2.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks tensors: mtp\.layers\.0\.mlp\.experts\.gate_up_proj"):
        load_draft_head(tmp_path, "mtp", read_hf_config(target[0]))


def test_misshapen_expert_tensor_is_refused(target: tuple[Path, list, bool], tmp_path: Path) -> None:
    """A fused gate_up with one expert too few, or one expert's up_proj transposed: refused by name."""
    (tmp_path / "config.json").write_text((target[0] / "config.json").read_text())
    tensors = load_file(str(target[0] / "mtp.safetensors"))
    bad = "mtp.layers.0.mlp.experts.gate_up_proj" if target[2] else "mtp.layers.0.mlp.experts.1.up_proj.weight"
    tensors[bad] = tensors[bad][:-1] if target[2] else tensors[bad].T.contiguous()
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(CheckpointError, match=rf"'{bad}' has shape"):
        load_draft_head(tmp_path, "mtp", read_hf_config(target[0]))
