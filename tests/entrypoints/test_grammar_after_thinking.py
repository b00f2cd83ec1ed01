"""A grammar (structured outputs, or a forced tool call) together with a thinking budget constrains the answer
only: the thinking section runs free until the model or the budget ends it with `</think>`, then the grammar
starts. On the embedded tiny model with a chat template that opens the thinking (as DeepSeek-R1's does); the
answer validates with `jsonschema`. The planted-fault control gates nothing (the grammar from the first token):
the budget's forced `</think>` is then refused by the grammar and the answer does not validate."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from helpers.thinking_chat import ASK, SCHEMA, THINKING_TEMPLATE, TOOLS, tiny_llm_on_one_thread

from framework import SamplingParams
from framework.params.structured_outputs import StructuredOutputsParams
from samplers.structured.thinking_gate import ThinkingGate

BUDGET = 3


@pytest.fixture(scope="module")
def llm():  # type: ignore[no-untyped-def]
    yield from tiny_llm_on_one_thread()


def _chat(llm, params, **kwargs):  # type: ignore[no-untyped-def]
    out = llm.chat(ASK, params, chat_template=THINKING_TEMPLATE, reasoning_parser="qwen3", use_tqdm=False, **kwargs)
    return out[0].outputs


def _schema_params(**kw) -> SamplingParams:  # type: ignore[no-untyped-def]
    so = StructuredOutputsParams(json=SCHEMA)
    return SamplingParams(max_tokens=40, temperature=0.9, seed=3, structured_outputs=so, **kw)


def test_schema_constrains_only_the_answer(llm):  # type: ignore[no-untyped-def]
    for seq in _chat(llm, _schema_params(thinking_token_budget=BUDGET)):
        assert seq.finish_reason == "stop" and seq.reasoning_content  # free thinking, then the answer
        assert seq.reasoning_tokens == BUDGET + len(llm.tokenizer.encode("</think>"))
        jsonschema.validate(json.loads(seq.text), SCHEMA)


def test_forced_tool_call_after_thinking(llm):  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=70, temperature=0.9, seed=5, thinking_token_budget=BUDGET)
    (seq,) = _chat(llm, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert seq.finish_reason == "tool_calls" and seq.reasoning_content
    jsonschema.validate(json.loads(seq.tool_calls[0]["function"]["arguments"]), SCHEMA)


def test_planted_fault_grammar_during_thinking_fails(llm, monkeypatch):  # type: ignore[no-untyped-def]
    """Control: with the gate off the grammar masks the thinking too; the forced end of thinking breaks it."""
    monkeypatch.setattr(ThinkingGate, "answer_tokens", lambda self, slot, tokens: tokens)
    monkeypatch.setattr(ThinkingGate, "add_request", lambda self, slot, params: None)
    seqs = _chat(llm, _schema_params(thinking_token_budget=BUDGET))
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        for seq in seqs:
            jsonschema.validate(json.loads(seq.text), SCHEMA)


def test_gate_opens_at_an_end_sequence_split_across_steps():  # type: ignore[no-untyped-def]
    gate = ThinkingGate(2)
    gate.add_request(0, SamplingParams(thinking_token_budget=4, thinking_end_token_ids=[7, 8, 9]))
    gate.add_request(1, SamplingParams())
    assert gate.answer_tokens(0, [1, 7]) == [] and gate.answer_tokens(0, [8]) == []
    assert gate.answer_tokens(0, [9, 5, 6]) == [5, 6] and gate.answer_tokens(0, [7]) == [7]
    assert gate.answer_tokens(1, [7, 8, 9]) == [7, 8, 9] and not np.any(gate.thinking)
