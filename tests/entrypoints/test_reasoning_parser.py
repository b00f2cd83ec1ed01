"""`<think>` reasoning split from the answer, whole and streamed in pieces, and tool calls read from the answer
only (`ChatOutputParser`)."""

from __future__ import annotations

import pytest

from framework.entrypoints.chat_output import ChatOutputParser
from framework.entrypoints.reasoning_parser import make_reasoning_parser
from framework.entrypoints.tool_calls import tool_setup

CASES = [
    ("qwen3", "<think>\nFirst, 2+3.\n</think>\n\nIt is 5.", "First, 2+3.", "It is 5."),
    ("qwen3", "It is 5.", "", "It is 5."),  # thinking off: no section
    ("qwen3", "<think>\nStill thinking when the tokens ran out", "Still thinking when the tokens ran out", ""),
    ("deepseek_r1", "First, 2+3.\n</think>\n\nIt is 5.", "First, 2+3.", "It is 5."),  # the template opened it
    ("deepseek_r1", "<think>First, 2+3.</think>It is 5.", "First, 2+3.", "It is 5."),
]


@pytest.mark.parametrize("name, text, reasoning, answer", CASES)
def test_reasoning_split_whole_and_streamed(name, text, reasoning, answer):  # type: ignore[no-untyped-def]
    assert make_reasoning_parser(name).extract(text) == (reasoning, answer)
    for size in (1, 2, 5, len(text)):
        parser = make_reasoning_parser(name)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        got = [parser.extract_delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        streamed_reasoning = "".join(r for r, _ in got)
        assert streamed_reasoning.strip() == reasoning and "<think>" not in streamed_reasoning, size
        assert "".join(a for _, a in got) == answer, size


def test_tool_calls_come_from_the_answer_only():  # type: ignore[no-untyped-def]
    tools = tool_setup(
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "auto", parser="hermes"
    )
    thought = '<think>maybe <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>?</think>'
    parser = ChatOutputParser(tools, "qwen3")
    parts = parser.parse(thought + "No call needed.")
    assert parts.tool_calls == [] and parts.content == "No call needed." and "tool_call" in (parts.reasoning or "")
    parts = parser.parse(thought + '<tool_call>{"name": "f", "arguments": {"y": 2}}</tool_call>')
    assert [c.arguments for c in parts.tool_calls] == ['{"y": 2}'] and parts.content is None
    assert parser.finish_reason("stop", True) == "tool_calls" and parser.finish_reason("length", True) == "length"
