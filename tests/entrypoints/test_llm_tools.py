"""`LLM.chat(..., tools=...)` offline on the embedded tiny model: forced calls validate against the function's
schema, `auto` parses the model's own call text, reasoning is split off, and bad tool fields are refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest

from framework import InvalidRequestError, SamplingParams
from framework.params.structured_outputs import StructuredOutputsParams

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
ASK = [{"role": "user", "content": "add 2 and 3"}]


@pytest.fixture(scope="module")
def llm():  # type: ignore[no-untyped-def]
    from framework import LLM

    return LLM("tiny", device="cpu")


def _exactly(text: str) -> SamplingParams:
    regex = "".join(c if c.isalnum() else f"[{c}]" for c in text)
    return SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(regex=regex))


def test_required_call_validates(llm):  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=1, n=2)
    out = llm.chat(ASK, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, use_tqdm=False)[0]
    for seq in out.outputs:
        assert seq.finish_reason == "tool_calls" and len(seq.tool_calls) == 1 and seq.text == ""
        call = seq.tool_calls[0]
        assert call["type"] == "function" and call["function"]["name"] == "add"
        jsonschema.validate(json.loads(call["function"]["arguments"]), ADD)


def test_auto_parses_call_text_and_reasoning(llm):  # type: ignore[no-untyped-def]
    text = '<think>sum</think>ok<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    out = llm.chat(ASK, _exactly(text), tools=TOOLS, reasoning_parser="qwen3", use_tqdm=False)[0]
    seq = out.outputs[0]
    assert (seq.reasoning_content, seq.text, seq.finish_reason) == ("sum", "ok", "tool_calls")
    assert json.loads(seq.tool_calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    plain = llm.chat(ASK, _exactly("no call"), tools=TOOLS, use_tqdm=False)[0].outputs[0]
    assert (plain.text, plain.tool_calls, plain.finish_reason) == ("no call", [], "stop")


def test_bad_tool_fields_are_refused(llm):  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match="'nope'"):
        llm.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidRequestError, match="combined with a forced tool call"):
        llm.chat(ASK, _exactly("x"), tools=TOOLS, tool_choice="required")
    with pytest.raises(InvalidRequestError, match="unknown tool-call parser"):
        llm.chat(ASK, tools=TOOLS, tool_parser="nope")
