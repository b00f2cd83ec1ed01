"""Each tool-call format on canned outputs written the way that family documents them: whole outputs, the same
outputs streamed in small pieces (the deltas must add up to the same calls, and no piece of a marker may reach
the content), and malformed calls, which come back as plain content."""

from __future__ import annotations

import json

import pytest

from framework.config.registry import TOOL_PARSERS
from framework.entrypoints.tool_parsers import detect_tool_parser, make_tool_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}},
            },
        },
    }
]
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
SUM = ("add", {"a": 1, "b": [2, 3]})

# (parser, output, expected content, expected calls)
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "Let me check.\n",
        [WEATHER],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>',
        "",
        [WEATHER, SUM],
    ),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}', "", [SUM]),  # never closed
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> and prose', "", [("f", {})]),  # prose dropped
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "argu', "", [("f", {})]),
    (
        "qwen3_coder",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "Checking.\n",
        [WEATHER],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=zip>\n75001\n"
        "</parameter>\n</function>\n</tool_call>",
        "",
        [("get_weather", {"city": "Paris", "zip": "75001"})],  # a string parameter stays text
    ),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "", [WEATHER]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}',
        "",
        [WEATHER, SUM],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}]',
        "",
        [WEATHER, SUM],
    ),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', "Sure. ", [WEATHER]),
]

MALFORMED = [
    ("hermes", 'Here: <tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),  # arguments not an object
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"),  # function never closed
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but not a call
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": '),
    ("mistral", "[TOOL_CALLS]get_weather{no args}"),
]


def _calls(calls):  # type: ignore[no-untyped-def]
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser_name: str, text: str, size: int):  # type: ignore[no-untyped-def]
    parser = make_tool_parser(parser_name, TOOLS)
    content, deltas = "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        c, d = parser.extract_delta(piece, i == len(pieces) - 1)
        content += c
        deltas += d
    return content, deltas


def _assemble(deltas):  # type: ignore[no-untyped-def]
    """OpenAI's client-side accumulation: per index, id/name from the first delta, arguments concatenated."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
        if "id" in d:
            assert call["name"] is None and d["type"] == "function" and d["id"].startswith("call_")
            call["name"] = d["function"]["name"]
        else:
            assert call["name"] is not None  # the name comes first
        call["arguments"] += d["function"].get("arguments", "")
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items()) if _parses(c["arguments"])]


def _parses(arguments: str) -> bool:
    """A streamed call the end of the output abandoned (cut off) keeps arguments that do not parse."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_canned_calls_are_parsed_whole_and_streamed(name, text, content, calls):  # type: ignore[no-untyped-def]
    got_content, got_calls = make_tool_parser(name, TOOLS).extract(text)
    assert got_content == content and _calls(got_calls) == [(n, a) for n, a in calls]
    for size in (1, 3, 7, len(text)):
        streamed_content, deltas = _stream(name, text, size)
        assert streamed_content == content, size
        assert _assemble(deltas) == [(n, a) for n, a in calls], size


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_calls_are_plain_content(name, text):  # type: ignore[no-untyped-def]
    assert make_tool_parser(name, TOOLS).extract(text) == (text, [])
    for size in (1, 4, len(text)):
        content, deltas = _stream(name, text, size)
        assert content == text and _assemble(deltas) == [], size


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "mistral"])
def test_plain_text_streams_without_holding_more_than_a_marker_prefix(name):  # type: ignore[no-untyped-def]
    parser = make_tool_parser(name)
    marker = parser.start_markers[0]
    content, calls = parser.extract_delta("hello " + marker[:-1], False)
    assert content == "hello " and calls == []  # the partial marker is held back, not shown
    content, calls = parser.extract_delta("x", True)
    assert content == marker[:-1] + "x" and calls == []  # it was not a marker after all


def test_registry_lists_the_formats_and_takes_plugins():  # type: ignore[no-untyped-def]
    assert {"hermes", "qwen3_coder", "llama3_json", "mistral"} <= set(TOOL_PARSERS.names())
    assert TOOL_PARSERS.group == "mrv2.tool_parsers"
    from framework.entrypoints.tool_parsers.hermes import HermesToolParser

    class Custom(HermesToolParser):
        name = "custom"

    TOOL_PARSERS.register("custom", Custom, source="test")
    try:
        assert type(make_tool_parser("custom")) is Custom
    finally:
        TOOL_PARSERS.unregister("custom")


def test_detect_from_template_text():  # type: ignore[no-untyped-def]
    assert detect_tool_parser("{{ '<tool_call>\\n' }}") == "hermes"
    assert detect_tool_parser("<tool_call>\n<function={{ name }}>\n<parameter={{ p }}>") == "qwen3_coder"
    assert detect_tool_parser("[TOOL_CALLS] {{ calls }}") == "mistral"
    assert detect_tool_parser("{{ messages }}") is None
