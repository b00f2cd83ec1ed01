"""thinking_token_budget: the Triton kernel against its reference (history, drafts, a natural end), and in the
engine against generation without a budget (the tokens before the budget are the model's own, then the end ids,
and nothing is forced when the model ended its thinking itself)."""

from __future__ import annotations

import pytest
import torch
from helpers.sampler_cases import make_history
from test_sampler_engine import _prompt

import samplers.triton_utils
from framework import InvalidRequestError, SamplingParams
from samplers.thinking_budget import apply_thinking_budget_reference, apply_thinking_budget_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INF = float("inf")


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def test_kernel_matches_reference(monkeypatch):
    monkeypatch.setattr(samplers.triton_utils, "MAX_VOCAB_BLOCK", 64)
    vocab, max_len = 150, 32
    history = make_history(5, max_len, DEVICE, num_draft=2)
    rows = {
        0: [40, 41, 7, 8, 9, 10],  # prompt 2; output 7 8 9 10: no end
        1: [30, 31, 32, 5, 6, 11, 12],  # prompt 3; the output starts with the end [5, 6] itself
        2: [20, 21, 22, 23, 24, 25, 5],  # prompt 2; the first end token was forced at output 4
        3: [1, 2, 3, 4, 5],  # prompt 1; drafts [6, 9] follow: the output 2 3 4 5 6 ends by itself
    }
    prompt = {0: 2, 1: 3, 2: 2, 3: 1}
    for slot, tokens in rows.items():
        history.all_token_ids[slot, : len(tokens)] = _i32(tokens)
        history.prompt_len[slot] = history.prefill_len[slot] = prompt[slot]
        history.total_len[slot] = len(tokens)
    history.draft_tokens[3] = _i32([6, 9])
    budget = _i32([4, 3, 4, 4, -1])
    end_ids = _i32([[5, 6, 0], [5, 6, 0], [5, 6, 0], [5, 6, 0], [0, 0, 0]])
    end_lens = _i32([2, 2, 2, 2, 0])
    # rows: slot 0 at output 4 (= budget: forced 5); slot 1 at output 4 (ended itself); slot 2 at output 5
    # (forced 6); slot 3 at outputs 3 (before the budget), 4 (forced 5) and 5 (its draft 6 ended it); slot 0 at
    # output 3; the padding slot.
    idx = _i32([0, 1, 2, 3, 3, 3, 0, 4])
    positions = torch.tensor([6, 7, 7, 4, 5, 6, 5, 3], device=DEVICE)
    logits = torch.randn(len(idx), vocab, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    args = (idx, positions, history, budget, end_ids, end_lens, 4)
    expected = apply_thinking_budget_reference(logits, *args)
    assert torch.equal(apply_thinking_budget_triton(logits.clone(), *args), expected)
    forced = {0: 5, 2: 6, 4: 5}
    for row in range(len(idx)):
        if row in forced:
            assert expected[row, forced[row]] == 0.0 and (expected[row] == -INF).sum() == vocab - 1
        else:
            assert torch.equal(expected[row], logits[row]), row


GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_budget_forces_the_end_after_that_many_tokens(tiny_llm_factory, async_scheduling):
    llm = tiny_llm_factory(async_scheduling=async_scheduling)
    prompt = _prompt(6, 7)
    free = llm.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0].token_ids
    end = [3, 250]
    params = [
        SamplingParams(**GREEDY, thinking_token_budget=4, thinking_end_token_ids=end),
        SamplingParams(**GREEDY, thinking_token_budget=0, thinking_end_token_ids=end),
        SamplingParams(**GREEDY),  # a neighbour without a budget
        # the model's own output holds the end sequence before the budget: nothing is forced
        SamplingParams(**GREEDY, thinking_token_budget=6, thinking_end_token_ids=free[1:3]),
    ]
    outs = llm.generate([prompt] * 4, params, use_tqdm=False)
    assert outs[0].token_ids[:6] == free[:4] + end
    assert outs[1].token_ids[:2] == end
    assert outs[2].token_ids == free
    assert outs[3].token_ids == free


def test_seeded_random_rows_keep_their_tokens_before_the_budget(tiny_llm_factory):
    llm = tiny_llm_factory()
    base = dict(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    free = llm.generate([_prompt(5, 3)], SamplingParams(**base), use_tqdm=False)[0].token_ids
    out = llm.generate(
        [_prompt(5, 3)], SamplingParams(**base, thinking_token_budget=5, thinking_end_token_ids=[9]), use_tqdm=False
    )[0].token_ids
    assert out[:6] == free[:5] + [9]


def test_default_end_ids_and_refusals(tiny_llm_factory):
    llm = tiny_llm_factory()
    out = llm.generate([_prompt(4, 1)], SamplingParams(**GREEDY, thinking_token_budget=2), use_tqdm=False)[0]
    assert out.token_ids[2:10] == list(b"</think>")  # the byte tokenizer's spelling of the default end
    with pytest.raises(InvalidRequestError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
    with pytest.raises(InvalidRequestError, match="thinking_end_token_ids"):
        SamplingParams(thinking_token_budget=3, thinking_end_token_ids=[])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(thinking_token_budget=1, thinking_end_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="V1 runner does not apply SamplingParams thinking_token_budget"):
        tiny_llm_factory(runner="v1").generate([[1, 2]], SamplingParams(thinking_token_budget=1), use_tqdm=False)
