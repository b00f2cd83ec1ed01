"""The grammar bitmask kernel against its reference (Triton interpreter), and the per-slot matcher state:
its masks, drafts included, against an independent llguidance matcher walked token by token."""

from __future__ import annotations

from types import SimpleNamespace

import llguidance
import numpy as np
import pytest
import torch

from framework import SamplingParams, StructuredOutputsParams
from framework.models.tokenizer import ByteTokenizer
from framework.params.scheduler_output import NewRequestData
from samplers.structured.backend import GuidanceBackend
from samplers.structured.bitmask import (
    apply_token_bitmask_reference,
    apply_token_bitmask_triton,
    bitmask_words,
)
from samplers.structured.state import StructuredOutputsState

VOCAB, EOS = 320, 256


def _random_masks(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_words(vocab)), generator=g, dtype=torch.int64).to(
        torch.int32
    )


@pytest.mark.parametrize("vocab", [7, 32, 100, 1100, 2049])
def test_bitmask_kernel_matches_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    masks = _random_masks(3, vocab, seed=vocab)
    masks[1] = -1  # all allowed
    masks[2, 0] = 0  # the first 32 tokens forbidden
    rows = torch.tensor([5, 0, 2], dtype=torch.int32)
    ref = apply_token_bitmask_reference(logits.clone(), masks, rows)
    out = apply_token_bitmask_triton(logits.clone(), masks, rows)
    assert torch.equal(out, ref)
    for row in (1, 3, 4):  # rows without a mask are untouched
        assert torch.equal(out[row], logits[row])
    assert torch.equal(out[0], logits[0])  # an all-ones mask changes nothing
    # The semantics, spelled out for one row: bit t % 32 of word t // 32.
    word = masks[0].tolist()
    allowed = torch.tensor([(word[t // 32] >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
    assert torch.equal(out[5] == float("-inf"), ~allowed)
    assert torch.equal(out[5][allowed], logits[5][allowed])


def test_bitmask_kernel_no_rows_and_bad_shapes() -> None:
    logits = torch.randn(2, 64)
    empty = torch.zeros(0, 2, dtype=torch.int32)
    assert torch.equal(apply_token_bitmask_triton(logits.clone(), empty, torch.zeros(0, dtype=torch.int32)), logits)
    with pytest.raises(ValueError, match=r"grammar bitmask must be int32 \[N, 2\] for vocabulary 64"):
        apply_token_bitmask_reference(logits, torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"logits_rows must be \[1\]"):
        apply_token_bitmask_triton(logits, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))


# ---- per-slot matcher state ----------------------------------------------------------------------------
def _new(
    request_id: str, structured: StructuredOutputsParams | None, prefill: list[int], prompt_len: int
) -> NewRequestData:
    return NewRequestData(request_id, prefill, prompt_len, SamplingParams(structured_outputs=structured), 0, [], 0)


def _reference_allowed(grammar: str, tokens: list[int]) -> set[int]:
    """Tokens allowed after `tokens`, by a fresh llguidance matcher (no rollback, no threads, no drafts)."""
    backend = GuidanceBackend(ByteTokenizer(), VOCAB, EOS)
    matcher = llguidance.LLMatcher(backend.lltokenizer, grammar, log_level=0)
    assert all(matcher.consume_token(t) for t in tokens)
    bits = matcher.compute_bitmask()
    return {t for t in range(VOCAB) if bits[t // 8] >> (t % 8) & 1}


def _allowed(mask_row: torch.Tensor) -> set[int]:
    words = mask_row.tolist()
    return {t for t in range(VOCAB) if (words[t // 32] >> (t % 32)) & 1}


def test_state_masks_drafts_and_rolls_back() -> None:
    backend = GuidanceBackend(ByteTokenizer(), VOCAB, EOS)
    regex = StructuredOutputsParams(regex="ab(c|d)+e")
    schema = StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {"k": {"enum": ["xy", "z"]}},
            "required": ["k"],
            "additionalProperties": False,
        },
        disable_any_whitespace=True,
    )
    state = StructuredOutputsState(4, 4 * 4, VOCAB, backend, torch.device("cpu"), next_output=lambda: 0)
    state.add_request(0, _new("r", regex, [1, 2, ord("a")], prompt_len=2))  # resumed: replays "a"
    state.add_request(1, _new("free", None, [1, 2], prompt_len=2))
    state.add_request(3, _new("j", schema, [5], prompt_len=1))
    assert state.any_in(np.array([0, 1])) and not state.any_in(np.array([1]))
    # Batch rows: slot 3 (3 drafts, the second refused by the grammar), slot 1 (unconstrained, 1 draft),
    # slot 0 (2 drafts, both valid). Logits rows: 0-3, 4-5, 6-8.
    drafts = [[ord("{"), ord("x"), ord('"')], [7], [ord("b"), ord("c")]]
    state.prepare(np.array([3, 1, 0]), np.array([0, 4, 6]), drafts)
    masks, rows = state.step_masks()  # type: ignore[misc]
    # slot 3: rows 0 and 1 ("{" is valid, "x" is not); slot 0: rows 6, 7, 8. Nothing for slot 1.
    assert rows.tolist() == [0, 1, 6, 7, 8]
    g_json, g_regex = backend.check(schema), backend.check(regex)
    expected = [
        _reference_allowed(g_json, []),
        _reference_allowed(g_json, [ord("{")]),
        _reference_allowed(g_regex, [ord("a")]),
        _reference_allowed(g_regex, [ord("a"), ord("b")]),
        _reference_allowed(g_regex, [ord("a"), ord("b"), ord("c")]),
    ]
    assert [_allowed(m) for m in masks] == expected
    assert ord("x") not in expected[1]  # the refused draft is forbidden on the row before it
    # The drafts were rolled back: the step's accepted tokens ("b" only) advance from "a".
    state.advance(0, ["r", "free", "j"], [[ord("b")], [9], [ord("{")]], {"r": 0, "free": 1, "j": 3})
    state.prepare(np.array([0, 3]), np.array([0, 1]), [[], []])
    masks, rows = state.step_masks()  # type: ignore[misc]
    assert [_allowed(m) for m in masks] == [
        _reference_allowed(g_regex, [ord("a"), ord("b")]),
        _reference_allowed(g_json, [ord("{")]),
    ]
    assert state.num_refused == 0


def test_state_ignores_old_outputs_and_stops_at_eos() -> None:
    backend = GuidanceBackend(ByteTokenizer(), VOCAB, EOS)
    seq = {"next": 5}
    state = StructuredOutputsState(2, 2, VOCAB, backend, torch.device("cpu"), next_output=lambda: seq["next"])
    state.add_request(0, _new("r", StructuredOutputsParams(choice=["ok"]), [1], prompt_len=1))
    state.advance(4, ["r"], [[ord("o")]], {"r": 0})  # an output from before the request joined: ignored
    state.advance(5, ["r"], [[ord("o"), ord("k"), EOS, ord("z")]], {"r": 0})  # what follows eos is dropped
    assert state.ended[0] and state.num_refused == 0
    state.prepare(np.array([0]), np.array([0]), [[]])
    assert state.step_masks() is None  # an ended request's leftover row is not masked
    state.remove_request(0)
    assert not state.active


@pytest.mark.parametrize("logprobs", [None, 3])
def test_sampler_applies_the_mask_first_fused_and_unfused(logprobs) -> None:
    """The bitmask is the sampler's first edit on both paths: every sampled token is allowed, the fused and the
    separate stages draw the same tokens, and raw logprobs see the mask."""
    from samplers.sampler import Sampler
    from samplers.states import SamplingStates

    history = SimpleNamespace(
        all_token_ids=torch.zeros(3, 16, dtype=torch.int32),
        prompt_len=torch.zeros(3),
        prefill_len=torch.zeros(3),
        total_len=torch.zeros(3),
        draft_tokens=torch.zeros(3, 0, dtype=torch.int32),
    )
    regex = StructuredOutputsParams(regex="[x-z]{3}")
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    idx = torch.tensor([0, 0, 1, 2], dtype=torch.int32)  # slot 0 verifies one draft: logits rows 0 and 1
    positions = torch.tensor([1, 2, 1, 1])
    outs = []
    for fused in (False, True):
        backend = GuidanceBackend(ByteTokenizer(), VOCAB, EOS)
        structured = StructuredOutputsState(3, 4, VOCAB, backend, torch.device("cpu"), next_output=lambda: 0)
        states = SamplingStates(
            3,
            torch.device("cpu"),
            vocab_size=VOCAB,
            history=history,  # type: ignore[arg-type]
            num_computed_host=lambda: np.zeros(3, dtype=np.int64),
            structured=structured,
        )
        for slot, so in enumerate([regex, None, regex]):
            params = SamplingParams(
                temperature=1.0 if slot else 0.0, seed=slot, logprobs=logprobs, structured_outputs=so
            )
            states.add_request(slot, NewRequestData(f"r{slot}", [1], 1, params, slot, [], 1))
        states.apply_staged_writes()
        # Batch rows: slot 0 (one draft, "y"), slot 1 (unconstrained), slot 2.
        structured.prepare(np.array([0, 1, 2]), np.array([0, 2, 3]), [[ord("y")], [], []])
        sampler = Sampler(states, fused=fused)
        stages = states.stages_for(np.arange(3))
        assert stages.any_structured
        outs.append(sampler(logits.clone(), idx, positions, stages))
    tokens = outs[0].sampled_token_ids.tolist()
    assert tokens == outs[1].sampled_token_ids.tolist()
    allowed = {ord("x"), ord("y"), ord("z")}
    assert {tokens[0], tokens[1], tokens[3]} <= allowed
    for row in (0, 1):  # slot 0 is greedy: the argmax over the allowed tokens, on its draft row too
        assert tokens[row] == max(allowed, key=lambda t: float(logits[row, t]))
    if logprobs is not None:
        for out in outs:
            top = out.logprobs.token_ids[0, 1:].tolist()
            assert set(top) == allowed and torch.isfinite(out.logprobs.logprobs[0]).all()
            # The unconstrained row's top tokens are the model's own.
            assert out.logprobs.token_ids[2, 1:].tolist() == logits[2].topk(3).indices.tolist()
