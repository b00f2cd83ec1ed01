"""gpt-oss outputs in the harmony format (openai-harmony's docs/format.md), as token sequences, read by channel.

Canned outputs are encoded by openai-harmony itself. For well-formed ones the reference is openai-harmony's own
`parse_messages_from_completion_tokens`: `reasoning_content` is its analysis messages' text, `content` its final and
commentary-preamble text, `tool_calls` its messages to `functions.*`. Every output is also streamed in chunks of 1,
2, 3 and 7 tokens: the deltas, accumulated as the openai client does, give exactly the non-streamed parse, and a
call is announced (index, id, name) before any of its arguments. Malformed outputs come back as plain content.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.harmony_models import harmony_encoding, write_vocab

from framework.entrypoints.harmony.output import MAX_HEADER_TOKENS, HarmonyOutputParser
from framework.entrypoints.tool_calls import tool_setup

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}},
]
SETUP = tool_setup(TOOLS, "auto", call_format="harmony")
A = "<|start|>assistant"
WELL_FORMED = [  # (output, reasoning, content, calls, finish)
    ("<|channel|>final<|message|>Hello!<|return|>", None, "Hello!", [], "stop"),
    (
        "<|channel|>analysis<|message|>User greets. Reply.<|end|>"
        + A
        + "<|channel|>final<|message|>Hi there<|return|>",
        "User greets. Reply.",
        "Hi there",
        [],
        "stop",
    ),
    (
        "<|channel|>analysis<|message|>Need weather.<|end|>"
        + A
        + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}<|call|>',
        "Need weather.",
        None,
        [("get_weather", '{"location": "Tokyo"}')],
        "tool_calls",
    ),
    (  # the recipient before the channel, as gpt-oss also writes it; a preamble first
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        + A
        + ' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|>',
        None,
        "Checking both.",
        [("add", '{"a": 1, "b": 2}')],
        "tool_calls",
    ),
    ("<|channel|>final<|message|>café ☕ naïve — 東京<|return|>", None, "café ☕ naïve — 東京", [], "stop"),
    (  # a final cut off by max_tokens: what was written stands
        "<|channel|>analysis<|message|>Think<|end|>" + A + "<|channel|>final<|message|>Partial ans",
        "Think",
        "Partial ans",
        [],
        "length",
    ),
    (  # cut off inside the next header after a whole message: the header is dropped
        "<|channel|>analysis<|message|>Only thinking<|end|>" + A + "<|channel|>fin",
        "Only thinking",
        "",
        [],
        "length",
    ),
]
MALFORMED = [  # (output, content, finish): plain content from where the format breaks, special tokens left out
    ("Hello world, no header at all.", "Hello world, no header at all.", "length"),
    ("<|channel|>final<|message|>Hi<|end|>garbage after the end", "Higarbage after the end", "length"),
    ("<|message|>no channel<|return|>", "no channel", "stop"),  # every message names its channel
    ("<|channel|>commentary to=python<|message|>print(1)<|call|>", "commentary to=pythonprint(1)", "stop"),
    ("<|channel|>final<|message|>ok<|end|><|start|>user<|message|>a user turn", "okusera user turn", "length"),
    ("<|channel|>fin", "fin", "length"),  # the first header, cut off
    (" word" * (MAX_HEADER_TOKENS + 5), " word" * (MAX_HEADER_TOKENS + 5), "length"),  # a header that never ends
]


@pytest.fixture(scope="module")
def encoding(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return harmony_encoding(write_vocab(tmp_path_factory.mktemp("o200k")))


def _tokens(encoding: Any, text: str) -> list[int]:
    return encoding.encode(text, allowed_special="all")


def _stream(encoding: Any, tokens: list[int], size: int, setup: Any = SETUP) -> tuple[str, str, list[dict], Any]:
    parser = HarmonyOutputParser(encoding, setup)
    reasoning, content, deltas = "", "", []
    chunks = [tokens[i : i + size] for i in range(0, len(tokens), size)] or [[]]
    for i, chunk in enumerate(chunks):
        part = parser.feed(encoding.decode(chunk), i == len(chunks) - 1, chunk)
        reasoning, content, deltas = reasoning + part.reasoning, content + part.content, deltas + part.tool_calls
    return reasoning, content, deltas, parser


def _client_view(deltas: list[dict]) -> list[tuple[str, str]]:
    """The openai client's accumulation: id, type and name first, then arguments joined per index."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["function"]["name"]
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
        else:
            calls[d["index"]]["arguments"] += d["function"]["arguments"]  # KeyError: arguments before the name
    assert sorted(calls) == list(range(len(calls)))
    return [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


def _reference(encoding: Any, tokens: list[int]) -> tuple[Any, str, list[tuple[str, str]]]:
    """openai-harmony's own parse, grouped by channel."""
    from openai_harmony import Role

    messages = encoding.parse_messages_from_completion_tokens(tokens, Role.ASSISTANT, strict=False)
    reasoning = "".join(m.content[0].text for m in messages if m.channel == "analysis" and m.recipient is None)
    content = "".join(m.content[0].text for m in messages if m.channel != "analysis" and m.recipient is None)
    calls = [(m.recipient[len("functions.") :], m.content[0].text) for m in messages if m.recipient]
    return reasoning or None, content, calls


@pytest.mark.parametrize("case", range(len(WELL_FORMED)))
def test_well_formed_outputs_split_by_channel(encoding, case):
    text, reasoning, content, calls, finish = WELL_FORMED[case]
    tokens = _tokens(encoding, text)
    parser = HarmonyOutputParser(encoding, SETUP)
    parts = parser.parse("", tokens)
    assert parts.reasoning == reasoning
    assert parts.content == content
    assert [(c.name, c.arguments) for c in parts.tool_calls] == calls
    if finish != "length":  # openai-harmony parses whole outputs only
        ref_reasoning, ref_content, ref_calls = _reference(encoding, tokens)
        assert (parts.reasoning, parts.content or "", [(c.name, c.arguments) for c in parts.tool_calls]) == (
            ref_reasoning,
            ref_content,
            ref_calls,
        )
    engine_reason = "length" if finish == "length" else "stop"
    assert parser.finish_reason(engine_reason, bool(parts.tool_calls)) == finish
    message = parser.message(parts)
    assert message["reasoning_content"] == reasoning and message["content"] == content
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == [c[0] for c in calls]


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize("case", range(len(WELL_FORMED) + len(MALFORMED)))
def test_streamed_deltas_join_to_the_parse(encoding, case, size):
    text = (WELL_FORMED + MALFORMED)[case][0]  # type: ignore[operator]
    tokens = _tokens(encoding, text)
    parts = HarmonyOutputParser(encoding, SETUP).parse("", tokens)
    reasoning, content, deltas, parser = _stream(encoding, tokens, size)
    assert (reasoning or None) == parts.reasoning
    assert content == (parts.content or "")
    assert _client_view(deltas) == [(c.name, c.arguments) for c in parts.tool_calls]
    ids = [d["id"] for d in deltas if "id" in d]
    assert ids == [c.id for c in parser.streamed_calls]  # the calls of the finished stream keep their ids


@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_malformed_outputs_are_plain_content(encoding, case):
    text, content, finish = MALFORMED[case]
    parser = HarmonyOutputParser(encoding, SETUP)
    parts = parser.parse("", _tokens(encoding, text))
    assert parts.content == content and parts.tool_calls == [] and parts.reasoning is None
    assert parser.finish_reason(finish, False) == finish


def test_a_call_without_tools_offered_is_content(encoding):
    """With no tools (or tool_choice none) a message to functions.* is no call: it comes back as content."""
    tokens = _tokens(encoding, '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>')
    parts = HarmonyOutputParser(encoding, tool_setup(None, None, call_format="harmony")).parse("", tokens)
    assert parts.tool_calls == [] and parts.content == 'commentary to=functions.f json{"a": 1}'


def test_streaming_holds_an_incomplete_character_of_plain_content(encoding):
    tokens = _tokens(encoding, "<|channel|>final<|message|>a<|end|>x☕y")
    parser = HarmonyOutputParser(encoding, SETUP)
    shown = ""
    for i, token in enumerate(tokens):
        part = parser.feed("", i == len(tokens) - 1, [token])
        assert "\ufffd" not in part.content
        shown += part.content
    assert shown == "ax☕y"


def test_reasoning_tokens_are_the_analysis_messages(encoding):
    analysis = "<|channel|>analysis<|message|>Let me think about it.<|end|>"
    tokens = _tokens(encoding, analysis + A + "<|channel|>final<|message|>Done.<|return|>")
    parser = HarmonyOutputParser(encoding, SETUP)
    assert parser.reasoning_tokens(tokens, "", []) == len(_tokens(encoding, analysis))
    assert parser.reasoning_tokens(_tokens(encoding, "<|channel|>final<|message|>x"), "", []) == 0


def test_planted_fault_routing_analysis_as_content_is_caught(encoding, monkeypatch):
    """Control: a parser that treats the analysis channel as the answer fails the reference comparison."""
    from framework.entrypoints.harmony import output

    original = output.HarmonyStream._route

    def planted(self, text, out):  # type: ignore[no-untyped-def]
        if self._kind == "reasoning":
            self._kind = "content"
        original(self, text, out)

    monkeypatch.setattr(output.HarmonyStream, "_route", planted)
    text, reasoning, content = WELL_FORMED[1][:3]
    parts = HarmonyOutputParser(encoding, SETUP).parse("", _tokens(encoding, text))  # type: ignore[arg-type]
    assert (parts.reasoning, parts.content) != (reasoning, content)


def test_each_token_costs_the_same_however_long_the_output(encoding, monkeypatch):
    """openai-harmony's `StreamableParser.state` serializes every content token so far (each step would cost the
    whole output): the loop follows the state from the tokens and never reads it."""
    import openai_harmony

    def serialized(self):  # type: ignore[no-untyped-def]
        raise AssertionError("StreamableParser.state read")

    monkeypatch.setattr(openai_harmony.StreamableParser, "state", property(serialized))
    text = "<|channel|>analysis<|message|>" + "think " * 300 + "<|end|>" + A + "<|channel|>final<|message|>ok<|return|>"
    assert HarmonyOutputParser(encoding, SETUP).parse("", _tokens(encoding, text)).content == "ok"
