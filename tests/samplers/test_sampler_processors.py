"""Penalties, logit bias, min_tokens, bad words and allowed ids against HF transformers' logits processors
(or an exact expected tensor), on the same logits, with rows in any slot order."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers.sampler_cases import Slot, make_sampler, run_edits
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from framework import SamplingParams

VOCAB = 40
EOS = 39


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _rows(idx: list[int]) -> torch.Tensor:
    return torch.tensor(idx, dtype=torch.int32)


def _hf(processor, input_ids: list[int], scores: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([input_ids]), scores.unsqueeze(0).clone()).squeeze(0)


def test_repetition_frequency_presence_penalties():
    """Repetition over prompt + output (HF's processor); frequency / presence over output counts only.

    Slot 0 was preempted: its prefill holds output, but the prompt boundary is prompt_len, not prefill_len."""
    slots = [
        Slot(
            SamplingParams(repetition_penalty=1.8, frequency_penalty=0.4, presence_penalty=0.3),
            prompt=[1, 2, 3, 3, 30],
            output=[4, 4, 4, 2, 17],
        ),
        Slot(SamplingParams(repetition_penalty=0.6), prompt=[5, 6], output=[7]),
        None,  # a free slot
        Slot(SamplingParams(frequency_penalty=-1.5, presence_penalty=2.0), prompt=[8, 9, 10], output=[11, 11, 8]),
        Slot(SamplingParams(), prompt=[12], output=[12, 13]),
    ]
    sampler, history = make_sampler(slots, VOCAB)
    idx = [3, 0, 4, 1, 0]
    logits = _logits(len(idx))
    out = run_edits(sampler, history, logits, _rows(idx))
    for row, req_slot in enumerate(idx):
        slot = slots[req_slot]
        p = slot.params
        expected = _hf(RepetitionPenaltyLogitsProcessor(p.repetition_penalty), slot.prompt + slot.output, logits[row])
        counts = Counter(slot.output)
        for token, n in counts.items():
            expected[token] -= p.frequency_penalty * n + p.presence_penalty
        torch.testing.assert_close(out[row], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[2], logits[2])  # no penalty: untouched


def test_penalty_counts_follow_sampled_tokens_and_reset_on_reuse():
    slots = [Slot(SamplingParams(frequency_penalty=1.0), prompt=[1, 2], output=[3])]
    sampler, history = make_sampler(slots, VOCAB)
    states = sampler.states
    # Two steps of one sampled token each (row 0 = slot 0), recorded on the "device".
    for token in (5, 5):
        states.record_sampled(_rows([0]), torch.tensor([[token]]), _rows([1]))
    logits = torch.zeros(1, VOCAB)
    out = run_edits(sampler, history, logits, _rows([0]))
    assert out[0, 5] == -2.0 and out[0, 3] == -1.0 and out[0, 1] == 0.0
    # A new owner of slot 0 with a penalty starts from its own history only.
    from framework.params.scheduler_output import NewRequestData

    history.all_token_ids[0, :2] = torch.tensor([9, 9], dtype=torch.int32)
    history.prompt_len[0] = history.prefill_len[0] = history.total_len[0] = 2
    states.remove_request(0)
    states.add_request(
        0, NewRequestData("new", [9, 9], 2, SamplingParams(presence_penalty=1.0, repetition_penalty=2.0), 0, [], 2)
    )
    states.apply_staged_writes()
    out = run_edits(sampler, history, torch.ones(1, VOCAB), _rows([0]))
    expected = torch.ones(VOCAB)
    expected[9] = 0.5  # in the prompt: repetition only; nothing in the output yet
    assert torch.equal(out[0], expected)


def test_logit_bias_matches_hf_sequence_bias():
    bias = {3: 2.5, 0: -7.0, VOCAB - 1: 1.25}
    slots = [Slot(SamplingParams(logit_bias=bias), prompt=[1]), Slot(SamplingParams(), prompt=[1])]
    sampler, history = make_sampler(slots, VOCAB)
    logits = _logits(3, seed=1)
    out = run_edits(sampler, history, logits, _rows([1, 0, 0]))
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    for row in (1, 2):
        torch.testing.assert_close(out[row], _hf(hf, [1], logits[row]))
    assert torch.equal(out[0], logits[0])


@pytest.mark.parametrize("num_output", [0, 2, 3, 5])
def test_min_tokens_matches_hf(num_output):
    """Stop ids (eos unless ignore_eos, and stop_token_ids) are excluded while output < min_tokens."""
    prompt = [1, 2, 3, 4]
    output = list(range(10, 10 + num_output))
    slots = [
        Slot(SamplingParams(min_tokens=3, stop_token_ids=[7, 8], max_tokens=10), prompt, output),
        Slot(SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=True, max_tokens=10), prompt, output),
    ]
    sampler, history = make_sampler(slots, VOCAB, eos_token_id=EOS)
    logits = _logits(2, seed=2)
    out = run_edits(sampler, history, logits, _rows([0, 1]))
    for row, stop_ids in ((0, [EOS, 7, 8]), (1, [7])):
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), 3, stop_ids)
        assert torch.equal(out[row], _hf(hf, prompt + output, logits[row]))


@pytest.mark.parametrize("output", [[], [5], [5, 6], [9, 5, 6, 7], [1, 2]])
def test_bad_words_match_hf_on_the_output(output):
    """HF's processor sees the whole sequence; vLLM's semantics (ours) only the output, so HF gets the output."""
    words = [[5, 6, 7], [6, 8], [33], [2, 3]]
    prompt = [4, 5, 6]  # [5, 6] ends the prompt, but a bad word must lie in the output
    slots = [Slot(SamplingParams(bad_words=words), prompt, output)]
    sampler, history = make_sampler(slots, VOCAB)
    logits = _logits(1, seed=3)
    out = run_edits(sampler, history, logits, _rows([0]))
    hf = NoBadWordsLogitsProcessor(words)
    assert torch.equal(out[0], _hf(hf, output or [0], logits[0]) if output else _only_single(logits[0], words))


def _only_single(logits: torch.Tensor, words: list[list[int]]) -> torch.Tensor:
    expected = logits.clone()
    for w in words:
        if len(w) == 1:
            expected[w[0]] = float("-inf")
    return expected


def test_allowed_token_ids_and_the_pipeline_order():
    """allowed -> bad words -> min_tokens -> bias -> penalties, each as its HF counterpart, in that order."""
    params = SamplingParams(
        allowed_token_ids=[2, 5, 6, 9, EOS],
        bad_words=[[4, 6]],
        min_tokens=4,
        logit_bias={9: 3.0},
        repetition_penalty=1.3,
        presence_penalty=0.5,
    )
    prompt, output = [2, 9, 1], [4]
    sampler, history = make_sampler([Slot(params, prompt, output)], VOCAB, eos_token_id=EOS)
    logits = _logits(1, seed=4)
    out = run_edits(sampler, history, logits, _rows([0]))[0]
    expected = torch.full((VOCAB,), float("-inf"))
    expected[[2, 5, 6, 9, EOS]] = logits[0, [2, 5, 6, 9, EOS]]
    expected = _hf(NoBadWordsLogitsProcessor([[4, 6]]), output, expected)
    expected = _hf(MinNewTokensLengthLogitsProcessor(len(prompt), 4, [EOS]), prompt + output, expected)
    expected = _hf(SequenceBiasLogitsProcessor([[[9], 3.0]]), prompt + output, expected)
    expected = _hf(RepetitionPenaltyLogitsProcessor(1.3), prompt + output, expected)
    expected[4] -= 0.5  # presence (token 4 is excluded anyway)
    torch.testing.assert_close(out, expected)
    assert torch.isfinite(out).nonzero().flatten().tolist() == [2, 5, 9]


def test_stages_are_skipped_when_no_request_uses_them():
    slots = [Slot(SamplingParams(temperature=0.0), prompt=[1]), Slot(SamplingParams(logit_bias={1: 1.0}), prompt=[1])]
    sampler, _ = make_sampler(slots, VOCAB)
    import numpy as np

    plain = sampler.states.stages_for(np.array([0]))
    assert not plain.any_logits_edit and not plain.any_random and plain.num_logprobs == -1
    assert sampler.states.stages_for(np.array([0, 1])).any_logit_bias
    assert sampler.states.penalties.counts is None  # nothing allocated for penalties nobody asked for
