"""Structured outputs end to end: sampled outputs validate (jsonschema), full-match their regex, are one of
their choices or parse under their grammar, with and without speculation, chunked prefill and preemption;
unconstrained neighbours are unchanged; bad grammars and the V1 runner are refused by name (on the trained
model, against HF transformers: test_structured_tiny_model.py)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

import jsonschema
import pytest
import torch

from framework import InvalidRequestError, SamplingParams, StructuredOutputsParams
from framework.entrypoints.llm import LLM
from samplers.structured.bitmask import apply_token_bitmask
from samplers.structured.state import StructuredOutputsState

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "name": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "XL"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "int_bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 37},
        "minItems": 1,
        "maxItems": 4,
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["code", "zip"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 2, "maxItems": 3},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["tags", "n"],
        "additionalProperties": False,
    },
}
REGEXES = [r"[a-z]{2,5}-[0-9]{1,3}", r"(yes|no|maybe)!+", r"0x[0-9a-f]{4}"]
CHOICES = ["alpha", "beta", "gamma delta", 'quo"te']
# Sums and differences of numbers, parenthesised: not a regular language, so checked with Python's parser.
GRAMMAR = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DYNAMIC = {
    "method": "ngram",
    "dynamic_k": True,
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "dynamic": {"explore_every": 2},
}
SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {},
    # 16 blocks of 8 tokens for 8-12 requests of ~60 tokens: preemption; 24 tokens per step: chunked prefills.
    "chunked_preempt": {"block_size": 8, "num_kv_blocks": 16, "max_num_batched_tokens": 24, "max_model_len": 96},
}


def _llm(speculator: Optional[dict] = None, **kwargs: Any) -> LLM:
    kwargs.setdefault("device", "cpu")
    if speculator is not None:
        kwargs["speculative_config"] = speculator
    return LLM("random_tiny", **kwargs)


def _count_preemptions(llm: LLM) -> dict[str, int]:
    counter = {"n": 0}
    scheduler = llm.engine.scheduler
    preempt = scheduler._preempt

    def counting(request):  # type: ignore[no-untyped-def]
        counter["n"] += 1
        return preempt(request)

    scheduler._preempt = counting
    return counter


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(32, 127, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def _run(
    llm: LLM, structured: list[StructuredOutputsParams], seeds: range, temperature: float = 0.9, max_tokens: int = 64
) -> list[tuple[StructuredOutputsParams, Any]]:
    """Every constraint with every seed, all in one batch; (constraint, output) pairs."""
    jobs = [(so, seed) for so in structured for seed in seeds]
    params = [
        SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so)
        for so, seed in jobs
    ]
    outs = llm.generate(_prompts(len(jobs), seed=len(jobs)), params, use_tqdm=False)
    return [(so, out) for (so, _), out in zip(jobs, outs)]


def _check(pairs: list[tuple[StructuredOutputsParams, Any]], min_stopped: float = 0.7) -> None:
    """Each stopped output satisfies its constraint; most outputs stop (so the checks are not vacuous)."""
    stopped = [(so, out) for so, out in pairs if out.finish_reason == "stop"]
    assert len(stopped) >= min_stopped * len(pairs), [o.text for _, o in pairs if o.finish_reason != "stop"][:5]
    for so, out in stopped:
        text = out.text
        if so.json is not None:
            jsonschema.validate(json.loads(text), so.json)
        elif so.regex is not None:
            assert re.fullmatch(so.regex, text), (so.regex, text)
        elif so.choice is not None:
            assert text in so.choice
        elif so.grammar is not None:
            _check_sum(ast.parse(text, mode="eval").body)
        else:
            assert isinstance(json.loads(text), dict)


def _check_sum(node: ast.AST) -> None:
    if isinstance(node, ast.BinOp):
        assert isinstance(node.op, (ast.Add, ast.Sub))
        _check_sum(node.left)
        _check_sum(node.right)
    else:
        assert isinstance(node, ast.Constant) and isinstance(node.value, int) and 1 <= node.value <= 999


def _all_kinds() -> list[StructuredOutputsParams]:
    return (
        [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in SCHEMAS.values()]
        + [StructuredOutputsParams(regex=r) for r in REGEXES]
        + [StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GRAMMAR)]
    )


def test_every_kind_validates_with_many_seeds() -> None:
    llm = _llm(max_num_seqs=64)
    _check(_run(llm, _all_kinds(), range(4)))
    llm.engine.step()  # the slots of the requests that finished last are freed at the next step
    state = llm.engine.runner.sampling_states.structured
    assert state.num_refused == 0 and not state.active


def test_json_object_and_flexible_whitespace() -> None:
    """Any JSON object, and a schema with vLLM's default whitespace handling (`whitespace_flexible`: any JSON
    whitespace allowed; the default here is at most one space, tests/samplers/test_json_whitespace.py).

    On the trained tiny model: the context-dependent random_tiny almost always loops on whitespace under this
    grammar until max_tokens, so with it no output would stop and the check would be vacuous."""
    llm = LLM("tiny", device="cpu")
    pairs = _run(
        llm,
        [
            StructuredOutputsParams(json_object=True, whitespace_flexible=True),
            StructuredOutputsParams(json=SCHEMAS["enums"], whitespace_flexible=True),
        ],
        range(8),
        max_tokens=96,
    )
    # Any whitespace allowed: samples may loop on whitespace until max_tokens, so the check asks only that some
    # outputs stop (and that every one that stops validates).
    _check([p for p in pairs if p[0].json is not None], min_stopped=0.25)
    for so, out in pairs:  # a random model rarely closes an open-ended object: what it wrote is a JSON prefix
        assert out.text.lstrip().startswith("{")
        if out.finish_reason == "stop":
            json.loads(out.text)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("speculator", [None, NGRAM, DYNAMIC], ids=["none", "ngram", "dynamic"])
def test_speculation_chunking_preemption(speculator: Optional[dict], scenario: str) -> None:
    llm = _llm(speculator, max_num_seqs=16, **SCENARIOS[scenario])
    preemptions = _count_preemptions(llm)
    kinds = [StructuredOutputsParams(json=SCHEMAS[n], disable_any_whitespace=True) for n in ("nested", "patterns")]
    kinds += [StructuredOutputsParams(regex=REGEXES[0]), StructuredOutputsParams(choice=CHOICES)]
    _check(_run(llm, kinds, range(3 if scenario == "plain" else 2), temperature=1.0))
    assert llm.engine.runner.sampling_states.structured.num_refused == 0
    if scenario == "chunked_preempt":
        assert preemptions["n"] > 0
    if speculator is not None:
        assert llm.get_metrics()["spec_decode"]["num_draft_tokens"] > 0


@pytest.mark.parametrize("speculator", [NGRAM, DYNAMIC], ids=["ngram", "dynamic"])
def test_greedy_speculation_changes_nothing(speculator: dict) -> None:
    """Greedy constrained output with drafts equals it without: draft rows are masked by the matcher after the
    drafts before them, and rejected drafts leave no trace in the matcher."""
    kinds = [
        StructuredOutputsParams(json=SCHEMAS["array_bounds"], disable_any_whitespace=True),
        StructuredOutputsParams(grammar=GRAMMAR),
        StructuredOutputsParams(regex=REGEXES[1]),
    ]

    def greedy(llm: LLM) -> list[list[int]]:
        return [o.token_ids for _, o in _run(llm, kinds, range(2), temperature=0.0, max_tokens=48)]

    plain = greedy(_llm())
    spec_llm = _llm(speculator, **SCENARIOS["chunked_preempt"])
    assert greedy(spec_llm) == plain
    assert spec_llm.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0


def test_unconstrained_neighbours_unchanged() -> None:
    free = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
    prompts = _prompts(4, seed=1)
    alone = [o.token_ids for o in _llm().generate(prompts, free, use_tqdm=False)]
    so = StructuredOutputsParams(json=SCHEMAS["enums"], disable_any_whitespace=True)
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=so) for s in range(4)]
    mixed_prompts = [p for pair in zip(prompts, _prompts(4, seed=2)) for p in pair]
    mixed_params = [p for pair in zip(free, constrained) for p in pair]
    outs = _llm().generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.token_ids for o in outs[0::2]] == alone
    _check([(so, o) for o in outs[1::2]], min_stopped=0.5)


def test_negative_control_masks_on_the_wrong_rows(monkeypatch) -> None:
    """Plant the bug the neighbour test guards against (masks one logits row off): it must show."""

    def shifted(self, logits):  # type: ignore[no-untyped-def]
        step = self.step_masks()
        self._step_rows = 0
        if step is None:
            return logits
        masks, rows = step
        return apply_token_bitmask(logits, masks, (rows + 1) % logits.shape[0])

    monkeypatch.setattr(StructuredOutputsState, "apply", shifted)
    with pytest.raises(AssertionError):
        test_unconstrained_neighbours_unchanged()


def test_grammar_end_stops_even_with_ignore_eos() -> None:
    llm = _llm()
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=40,
            ignore_eos=True,
            structured_outputs=StructuredOutputsParams(choice=["done", "finished"]),
        )
        for s in range(6)
    ]
    outs = llm.generate(_prompts(6, seed=3), params, use_tqdm=False)
    assert all(o.finish_reason == "stop" and o.text in ("done", "finished") for o in outs)
    assert all(o.token_ids[-1] == llm.engine.loaded.eos_token_id for o in outs)


def test_min_tokens_past_the_grammar_end_is_refused_or_an_error_that_says_so(monkeypatch) -> None:
    """A grammar whose every output is shorter than min_tokens is refused at validation, naming both fields. Where
    the check is undecided (a grammar too large to walk), the grammar ends (only end of sequence is allowed) and
    min_tokens forbids it: no token is left, and the request ends with an error naming that cause
    (docs/structured-outputs.md) while its neighbour is unaffected."""
    llm = _llm()
    choice = SamplingParams(max_tokens=10, min_tokens=6, structured_outputs=StructuredOutputsParams(choice=["ab"]))
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.choice always ends before .*min_tokens=6"):
        llm.generate(_prompts(1, seed=5), choice, use_tqdm=False)
    long_enough = SamplingParams(
        max_tokens=10, min_tokens=3, structured_outputs=StructuredOutputsParams(choice=["ab", "abcdef"])
    )
    out = llm.generate(_prompts(1, seed=5), long_enough, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == "abcdef"  # min_tokens holds off the shorter choice
    monkeypatch.setattr(type(llm.engine.runner.grammar_backend), "can_run_for", lambda *a, **k: None)
    failed, free = llm.generate(_prompts(2, seed=5), [choice, SamplingParams(max_tokens=5)], use_tqdm=False)
    assert failed.finish_reason == "error" and "grammar" in failed.error and "min_tokens" in failed.error
    assert free.finish_reason == "length" and len(free.token_ids) == 5


def test_grammars_are_compiled_once_per_text() -> None:
    llm = _llm()
    backend = llm.engine.runner.grammar_backend
    so = [
        StructuredOutputsParams(json=SCHEMAS["enums"]),
        StructuredOutputsParams(json=json.dumps(SCHEMAS["enums"])),
    ]  # the same schema as text
    llm.generate(
        _prompts(6, seed=4),
        [SamplingParams(max_tokens=8, structured_outputs=so[i % 2]) for i in range(6)],
        use_tqdm=False,
    )
    assert backend.num_compiled == 1


@pytest.mark.parametrize(
    "so, message",
    [
        (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex is invalid: .*unclosed character class"),
        (StructuredOutputsParams(grammar="start: foo"), "structured_outputs.grammar is invalid: .*unknown name"),
        (StructuredOutputsParams(json={"type": "strin"}), "structured_outputs.json is invalid: .*strin"),
        (StructuredOutputsParams(json={"type": "object", "properties": 3}), "structured_outputs.json is invalid"),
    ],
)
def test_malformed_constraints_are_refused_by_name(so, message) -> None:
    llm = _llm()
    with pytest.raises(InvalidRequestError, match="request 'gen-0': SamplingParams." + message):
        llm.generate([[1, 2, 3]], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_v1_refuses_by_name() -> None:
    llm = _llm(runner="v1")
    with pytest.raises(InvalidRequestError, match="V1 runner does not apply SamplingParams structured_outputs"):
        llm.generate([[1, 2]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")), use_tqdm=False)


def test_negative_control_resume_without_replay(monkeypatch) -> None:
    """Plant the bug preemption guards against (a resumed request's matcher starts over instead of replaying its
    earlier output): the grammar then refuses the tokens that follow, or outputs stop invalid."""
    import dataclasses

    add = StructuredOutputsState.add_request

    def forgetful(self, req_slot, new):  # type: ignore[no-untyped-def]
        add(self, req_slot, dataclasses.replace(new, prefill_token_ids=new.prefill_token_ids[: new.prompt_len]))

    monkeypatch.setattr(StructuredOutputsState, "add_request", forgetful)
    with pytest.raises((AssertionError, ValueError, jsonschema.ValidationError)):
        test_speculation_chunking_preemption(None, "chunked_preempt")
