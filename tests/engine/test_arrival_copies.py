"""What an arrival keeps of its caller's objects: its own deep copy of the SamplingParams (made field by field,
not by `copy.deepcopy`), a prompt check equal to the one-by-one search, and detokenizers that share one decode
function per `skip_special_tokens` value without mixing the values up."""

from __future__ import annotations

import copy
import random
from dataclasses import fields
from typing import Any

import numpy as np
import pytest

from framework import InvalidRequestError, SamplingParams
from framework.engine.output_processor import OutputProcessor
from framework.engine.request import Request
from framework.params.sampling_params import first_invalid_token_index
from framework.params.structured_outputs import StructuredOutputsParams


def _every_mutable_field() -> SamplingParams:
    return SamplingParams(
        stop=["x", "yz"],
        stop_token_ids=[3, 4],
        logit_bias={"5": 1.5, 6: -2.0},
        allowed_token_ids=[1, 2, 3],
        bad_words=["ab", [7, 8]],
        max_tokens=9,
        seed=2,
        extra_args={"scale": [1.0, {"deep": [2]}], "name": "n"},
        structured_outputs=StructuredOutputsParams(json={"type": "object", "required": ["a"]}),
    )


def _containers(value: Any) -> list[Any]:
    """Every list/dict/object reachable from `value` (what a shallow copy would share)."""
    found: list[Any] = []
    if isinstance(value, (list, tuple)):
        found = [value] if isinstance(value, list) else []
        for item in value:
            found += _containers(item)
    elif isinstance(value, dict):
        found = [value]
        for item in value.values():
            found += _containers(item)
    elif hasattr(value, "__dict__"):
        found = [value] + _containers(vars(value))
    return found


def test_clone_equals_deepcopy_and_shares_no_mutable_part():
    params = _every_mutable_field()
    params.resolve_bad_words(lambda text: [ord(c) for c in text])
    clone, reference = params.clone(), copy.deepcopy(params)
    assert type(clone) is SamplingParams and clone == reference and clone == params
    assert clone._bad_words_token_ids == reference._bad_words_token_ids == [[97, 98], [7, 8]]
    for f in fields(SamplingParams):
        ours, theirs = getattr(clone, f.name), getattr(params, f.name)
        shared = {id(c) for c in _containers(ours)} & {id(c) for c in _containers(theirs)}
        assert not shared, f"clone shares a mutable part of {f.name}"
    assert clone.is_greedy == params.is_greedy and clone.bad_words_token_ids == params.bad_words_token_ids


def test_params_changed_after_add_request_do_not_reach_the_queued_requests(tiny_llm_factory):
    engine = tiny_llm_factory().engine
    shared = SamplingParams(
        max_tokens=7,
        stop_token_ids=[3],
        logit_bias={5: 1.0},
        allowed_token_ids=[1, 2, 5],
        bad_words=["ab"],
        extra_args={"k": [1]},
    )
    engine.add_request("a", [1, 2, 3], shared)
    engine.add_request("b", [4, 5, 6], shared)  # one params object for many requests, as LLM.generate passes it
    queued = [engine.scheduler.requests[r].sampling_params for r in ("a", "b")]
    assert queued[0] is not queued[1] and queued[0] is not shared
    snapshot = copy.deepcopy(queued[0])
    shared.max_tokens = 99
    shared.stop_token_ids.append(9)
    shared.logit_bias[6] = -1.0
    shared.allowed_token_ids.append(7)
    shared.bad_words.append([8])
    shared.extra_args["k"].append(2)
    for params in queued:
        assert params == snapshot and params.bad_words_token_ids == [[97, 98]]
    assert shared._bad_words_token_ids is None  # the engine resolved the words on its own copy
    assert engine.scheduler.requests["a"].max_output_len == 7 and engine.scheduler.requests["a"].stop_token_set >= {3}


def _one_by_one(ids: Any, vocab: int) -> Any:
    return next(
        (i for i, t in enumerate(ids) if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)), None
    )


def test_first_invalid_token_index_equals_the_one_by_one_search():
    rng = random.Random(0)
    odd = [True, False, None, -1, 320, 10**30, 2.0, "3", np.int64(4)]
    cases: list[Any] = [[], [0], [319], (1, 2, 3), list(range(320))]
    for _ in range(300):
        ids: list[Any] = [rng.randrange(320) for _ in range(rng.randint(1, 12))]
        for _ in range(rng.randint(0, 2)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(odd))
        cases.append(ids)
    for ids in cases:
        assert first_invalid_token_index(ids, 320) == _one_by_one(ids, 320), ids
    assert first_invalid_token_index([1, True, 2], 320) == 1 and first_invalid_token_index([5, 320], 320) == 1


def test_a_prompt_holding_none_is_refused(tiny_llm_factory):
    """The search used to return the bad item itself, and None looked like "nothing bad": such a prompt was queued."""
    engine = tiny_llm_factory().engine
    with pytest.raises(InvalidRequestError, match=r"token id None is outside the vocabulary \[0, 320\)"):
        engine.add_request("x", [1, None, 3], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


class _RecordingTokenizer:
    """decode() that shows whether it was asked to skip special tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ("skip:" if skip_special_tokens else "keep:") + ",".join(map(str, ids))


def test_detokenizers_share_one_decode_per_skip_special_tokens_value():
    processor = OutputProcessor(_RecordingTokenizer(), scheduler=None)  # type: ignore[arg-type]
    for request_id, skip in (("a", True), ("b", False), ("c", True)):
        params = SamplingParams(skip_special_tokens=skip, output_kind="delta")
        processor.add_request(Request(request_id=request_id, prompt_token_ids=[1], sampling_params=params))
    detoks = {r: processor._states[r].detokenizer for r in "abc"}
    assert [detoks[r]._decode([5]) for r in "abc"] == ["skip:5", "keep:5", "skip:5"]
    assert detoks["a"]._decode is detoks["c"]._decode and detoks["a"]._decode is not detoks["b"]._decode
