"""The pieces of training/train_tiny.py and training/eval_tiny.py that can be wrong without crashing:
the held-out split, the tokenizer files, the draft heads' shift convention and the acceptance simulation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from training.acceptance import AcceptanceStats, ngram_drafter, simulate
from training.base_model import TrainSettings, WindowSampler, lr_at
from training.data import SourceFile, encode_stream, is_held_out, save_tokenizer, train_tokenizer
from training.heads import HeadSettings, _unrolled_losses

CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\nfor name in os.listdir('.'):\n    print(name)\n",
    "# ünïcode comment\nvalue = {'key': [1, 2, 3]}\n",
] * 20


def test_held_out_split_is_deterministic_and_about_the_asked_fraction():
    paths = [f"pkg{i // 50}/module_{i}.py" for i in range(4000)]
    held = [p for p in paths if is_held_out(p, 0.03)]
    assert held == [p for p in paths if is_held_out(p, 0.03)]
    assert 0.02 < len(held) / len(paths) < 0.04
    assert set(held) <= {p for p in paths if is_held_out(p, 0.10)}  # a larger fraction holds out a superset


def test_tokenizer_files_load_in_transformers_and_mrv2_alike(tmp_path):
    from transformers import AutoTokenizer

    from framework.models.tokenizer import load_tokenizer

    tok = train_tokenizer(CODE, vocab_size=300)
    save_tokenizer(tok, tmp_path, model_max_length=128)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.token_to_id("<|endoftext|>")}))
    ours = load_tokenizer(str(tmp_path), {})
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.eos_token_id == theirs.eos_token_id == 0
    for text in CODE[:4] + ["x = '🙂'\n\tindented  twice  "]:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == text == theirs.decode(ids)
    assert ours.decode([0], skip_special_tokens=False) == "<|endoftext|>" and ours.decode([0]) == ""
    stream = encode_stream(tok, [SourceFile("a.py", CODE[0]), SourceFile("b.py", CODE[1])])
    assert stream.dtype == np.int32 and list(stream).count(0) == 2 and stream[-1] == 0  # eos after each file


def test_window_sampler_targets_are_the_inputs_shifted():
    sampler = WindowSampler(np.arange(100, dtype=np.int32), seq_len=8, batch_size=4, seed=0, device=torch.device("cpu"))
    inputs, targets = sampler.next()
    assert inputs.shape == targets.shape == (4, 8)
    assert torch.equal(targets[:, :-1], inputs[:, 1:]) and torch.equal(targets, inputs + 1)


def test_learning_rate_warms_up_then_decays_by_elapsed_time():
    s = TrainSettings(peak_lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(s, 0, 0.0) == pytest.approx(0.1) and lr_at(s, 9, 0.0) == pytest.approx(1.0)
    assert lr_at(s, 100, 0.5) == pytest.approx(0.55) and lr_at(s, 100, 1.0) == pytest.approx(0.1)


class _OracleHead(torch.nn.Module):
    """A head that is exactly right when the target's feature of a position is the embedding of its token:
    it returns the embedding of the token it reads. With the shift wrong, it would predict the wrong token."""

    def __init__(self, embed: torch.Tensor, shift: int = 0) -> None:
        super().__init__()
        self.embed = embed
        self.shift = shift
        self.calls: list[tuple[int, int]] = []  # (step, first position)

    def forward(self, ids, hidden, positions=None, step=0):  # type: ignore[no-untyped-def]
        self.calls.append((step, int(positions[0, 0])))
        return self.embed[torch.roll(ids, self.shift, dims=1)]

    def compute_logits(self, hidden, step=0):  # type: ignore[no-untyped-def]
        return (hidden @ self.embed.T).float()


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_head_loss_shift_matches_the_speculator_convention(kind):
    vocab, dim = 50, 16
    embed = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0)) * 3
    window = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(1))
    feats = embed[window[:, :-1]]  # a target whose feature at p is the embedding of token p
    settings = HeadSettings(unroll_steps=3, input_noise=0.0)
    right = _OracleHead(embed)
    loss, agreements = _unrolled_losses(right, kind, embed, window, feats, settings, training=False)
    assert [float(a.mean()) for a in agreements] == [1.0, 1.0, 1.0]
    assert right.calls == [(0, 0), (1, 1), (2, 2)]  # step s runs at positions p + s
    _, wrong = _unrolled_losses(_OracleHead(embed, shift=1), kind, embed, window, feats, settings, training=False)
    assert all(float(a.mean()) < 0.5 for a in wrong)


def test_simulated_acceptance_of_perfect_and_useless_drafters():
    seq = torch.arange(40)
    perfect = AcceptanceStats()
    simulate(seq, 10, lambda s, k: list(range(len(s), len(s) + k)), 3, perfect)
    # 30 tokens: the prefill's one, 7 steps of 3 accepted drafts + 1 target token (28), then a plain step
    assert (perfect.steps, perfect.drafted, perfect.accepted) == (7, 21, 21)
    assert perfect.as_dict()["per_position_acceptance"] == [1.0, 1.0, 1.0]
    useless = AcceptanceStats()
    simulate(seq, 10, lambda s, k: [-1] * k, 3, useless)
    # 29 tokens after the prefill's; the last one is a plain decode step (no room for a draft)
    assert useless.mean_acceptance_length == 1.0 and useless.steps == 28


def test_ngram_drafter_copies_after_the_latest_longest_match():
    draft = ngram_drafter(prompt_lookup_min=2, prompt_lookup_max=3)
    seq = torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert draft(seq, 2) == [7, 5]  # suffix [1, 2, 3]: its latest earlier occurrence is followed by 7, 5
    assert draft(seq, 4) == [7, 5, 1, 2]
    assert draft(torch.tensor([4, 5, 6, 7]), 3) == [7, 7, 7]  # no match: the last token repeated
    assert draft(torch.tensor([8, 8, 8, 8]), 3) == [8, 8, 8]  # match ends just before the end: padded
    stats = AcceptanceStats()
    simulate(torch.tensor([1, 2, 3, 4] * 6), 8, draft, 4, stats)
    assert stats.accepted == stats.drafted == 12 and stats.steps == 3  # repeating: every draft accepted
