"""The Qwen3.5 MTP draft head (`mtp.*` tensors in the target checkpoint) on the hybrid recurrent target.

- the head's logits equal a hand-written PyTorch reference of the formula read from the config (zero-centred
  norms, embedding-first concat, fc, gated attention with partial rotary and q/k norms, dense MLP, final norm,
  the target's LM head); the reference catches a wrong norm offset (a planted fault the engine-level equality
  below cannot see: drafts only change speed);
- `speculator.method=mtp` on a tiny random Qwen3.5 checkpoint with random `mtp.*` tensors: greedy tokens equal
  the run without speculation (mixed prompt lengths, chunked prefill) and acceptance stats are reported; with
  the recurrent state advanced by every verified token instead of the accepted ones, the tokens differ;
- a checkpoint without `mtp.*` tensors (or without `mtp_num_hidden_layers`) asking for MTP is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.gdn_models import QWEN3_5, slow_decay_checkpoint
from helpers.hf_models import random_prompts
from helpers.qwen_mtp import fitted_mtp_tensors, random_mtp_tensors, reference_logits
from safetensors.torch import save_file

from framework.entrypoints.llm import LLM
from framework.models.loader import CheckpointError, read_hf_config
from framework.params.sampling_params import SamplingParams
from model_states.hybrid_recurrent import HybridRecurrentModelState
from speculators.draft_heads import Qwen3NextMTPHead, load_draft_head

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 12
PROMPTS = random_prompts(3, 5, 26, seed=11)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A Qwen3.5 checkpoint with a fitted MTP head, and the greedy tokens of PROMPTS without speculation (equal to
    HF's: tests/model_states/test_gdn_hybrid.py)."""
    path = tmp_path_factory.mktemp("qwen3_5-mtp")
    model = slow_decay_checkpoint(QWEN3_5, path)
    tokens = [o.token_ids for o in _llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)]
    tensors = fitted_mtp_tensors(path, model, [p + t for p, t in zip(PROMPTS, tokens)])
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return path, tokens


@pytest.fixture(scope="module")
def random_head(target: tuple[Path, list[list[int]]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's config and a random MTP head (every norm weight nonzero), alone in a directory."""
    path = tmp_path_factory.mktemp("qwen3_5-mtp-random")
    (path / "config.json").write_text((target[0] / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in random_mtp_tensors(path, seed=0).items()}, str(path / "mtp.safetensors"))
    return path


def _llm(path: Path, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=64, seed=0, **kwargs)


# ---- the head against a hand-written reference (helpers.qwen_mtp.reference_logits) ------------------------
def _head_and_reference(head_dir: Path, target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    cfg = json.loads((head_dir / "config.json").read_text())
    tensors, base = load_file(str(head_dir / "mtp.safetensors")), load_file(str(target_dir / "model.safetensors"))
    embed, lm_head = base["model.embed_tokens.weight"], base["lm_head.weight"]
    head = load_draft_head(head_dir, "mtp", read_hf_config(target_dir))
    assert isinstance(head, Qwen3NextMTPHead)
    head.share_target_weights(embed, lm_head)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg["vocab_size"], (9,), generator=gen)
    hidden = torch.randn(9, cfg["hidden_size"], generator=gen)
    with torch.no_grad():
        ours = head.compute_logits(head(ids[None], hidden[None]))[0]
    return ours, reference_logits(tensors, cfg, embed, lm_head, ids, hidden)


def test_head_logits_match_the_formula(target: tuple[Path, list], random_head: Path) -> None:
    ours, ref = _head_and_reference(random_head, target[0])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_planted_norm_offset_is_caught(
    target: tuple[Path, list], random_head: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain RMSNorm (`x * w`) in place of the zero-centred one: the reference sees it."""
    from framework.models.qwen3_next import OffsetRMSNorm

    def plain(self, x):  # type: ignore[no-untyped-def]
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)

    monkeypatch.setattr(OffsetRMSNorm, "forward", plain)
    ours, ref = _head_and_reference(random_head, target[0])
    assert not torch.allclose(ours, ref, atol=1e-3, rtol=1e-3)


# ---- the engine -----------------------------------------------------------------------------------------------
def test_mtp_speculation_keeps_greedy_tokens(target: tuple[Path, list[list[int]]]) -> None:
    """Equal to the greedy tokens without speculation."""
    path, want = target
    llm = _llm(path, speculative_config=MTP, max_num_batched_tokens=7)  # prompts cut into chunks
    assert isinstance(llm.engine.runner.model_state, HybridRecurrentModelState)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.spec_metrics
    print(f"MTP acceptance: {stats.as_dict()}")
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some kept, some not
    # The fitted first draft is right wherever the paged first pass lines tokens and hidden states up correctly.
    assert stats.per_position_acceptance[0] > 0.9


def test_planted_state_advanced_by_every_draft_is_caught(
    target: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    original = HybridRecurrentModelState.postprocess

    def keep_all(self, batch, num_sampled, num_rejected):  # type: ignore[no-untyped-def]
        return original(self, batch, num_sampled, torch.zeros_like(num_rejected))

    monkeypatch.setattr(HybridRecurrentModelState, "postprocess", keep_all)
    outs = _llm(target[0], speculative_config=MTP).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] != target[1]


def test_checkpoint_without_mtp_is_refused(tmp_path: Path) -> None:
    slow_decay_checkpoint(QWEN3_5, tmp_path)
    with pytest.raises(CheckpointError, match="needs speculator.model, or a target checkpoint"):
        _llm(tmp_path, speculative_config=MTP)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match=r"no mtp\.\* tensors"):
        _llm(tmp_path, speculative_config=MTP)
