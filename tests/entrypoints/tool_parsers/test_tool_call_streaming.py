"""Tool calls streamed token by token, for every registered format: the deltas of a stream, accumulated as the
openai client does, equal the non-streamed parse of the same output, whole, malformed or cut off anywhere (as
`max_tokens` cuts it). A call is announced with its name, then its arguments grow in several fragments; before
the output ends a call's arguments never parse, so a call the end abandons is told apart by its arguments (and
the turn does not finish with "tool_calls"). Malformed call text comes back as content, never lost."""

from __future__ import annotations

import json

import pytest
from test_tool_parsers import CASES, MALFORMED, TOOLS

from framework.entrypoints.tool_parsers import make_tool_parser
from framework.entrypoints.tool_parsers.json_prefix import json_prefix

EXTRA = [  # formats written unusually: keys out of order, escapes, nested arguments, spaces
    ("hermes", '<tool_call>{"arguments":{"q":"a \\"b\\" \\u00e9\\n","n":[1,{"x":null}]},"name":"search"}</tool_call>'),
    ("hermes", 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}} junk</tool_call>'),  # malformed after args
    ("llama3_json", '{"name": "f", "parameters": {"a": -1.50e2, "b": true}}'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": "x"}'),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"),
]
OUTPUTS = [(n, t) for n, t, _, _ in CASES] + MALFORMED + EXTRA


def _parses(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def _stream(name: str, text: str, size: int):  # type: ignore[no-untyped-def]
    parser = make_tool_parser(name, TOOLS)
    content, deltas, before_end = "", [], []
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        c, d = parser.extract_delta(piece, i == len(pieces) - 1)
        content += c
        deltas += d
        if i < len(pieces) - 1:
            before_end += d
    return parser, content, deltas, before_end


def _client_view(deltas):  # type: ignore[no-untyped-def]
    """The openai client's accumulation: per index, id / type / name from the first delta, arguments joined."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["function"]["name"]
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        calls[d["index"]]["arguments"] += d["function"].get("arguments", "")  # KeyError: a fragment before its name
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def _check(name: str, text: str, size: int) -> None:
    content, calls = make_tool_parser(name, TOOLS).extract(text)
    parser, got, deltas, before_end = _stream(name, text, size)
    assert got == content, (text, size)
    view = _client_view(deltas)
    stands = [c for c in view if _parses(c["arguments"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in stands] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ], (text, size)
    assert view[: len(stands)] == stands  # abandoned calls only after the ones that stand
    assert [c.id for c in parser.calls] == [c["id"] for c in stands]  # what decides finish_reason "tool_calls"
    for c in _client_view(before_end) if before_end else []:
        assert not _parses(c["arguments"])  # nothing parses before the end confirms it


@pytest.mark.parametrize("name, text", OUTPUTS)
def test_streamed_deltas_equal_the_whole_parse(name, text):  # type: ignore[no-untyped-def]
    for size in (1, 3, len(text)):
        _check(name, text, size)


@pytest.mark.parametrize("name, text", OUTPUTS)
def test_every_cut_equals_the_whole_parse_of_the_cut_text(name, text):  # type: ignore[no-untyped-def]
    for cut in range(0, len(text), 2):
        _check(name, text[:cut], 5)


@pytest.mark.parametrize("name, text", [(n, t) for n, t, _, calls in CASES if calls and calls[0][1]])
def test_arguments_arrive_in_many_fragments_after_the_name(name, text):  # type: ignore[no-untyped-def]
    _, _, deltas, before_end = _stream(name, text, 1)
    announced = [d for d in before_end if "id" in d]
    fragments = [d for d in before_end if d["function"].get("arguments") and d["index"] == 0]
    assert announced and announced[0]["index"] == 0
    assert len(fragments) >= 3 or name == "qwen3_coder"  # the XML format grows by whole parameters
    assert fragments and deltas.index(announced[0]) < deltas.index(fragments[0])


def test_json_prefix_is_the_certain_prefix_of_the_normal_form():  # type: ignore[no-untyped-def]
    raw = '{"a":1,"b":[2,3.50,{"c":"x\\u00e9\\n\\ud83d\\ude00"}],"d":true,"e":null,"f":-1e2}'
    full, previous = json.dumps(json.loads(raw), ensure_ascii=False), ""
    for k in range(len(raw) + 1):
        prefix = json_prefix(raw[:k])
        assert prefix.valid and full.startswith(prefix.text) and prefix.text.startswith(previous)
        previous = prefix.text
    assert json_prefix(raw).text == full and json_prefix(raw + " tail").end == len(raw)
    assert not json_prefix('{"a": 1 x').valid and json_prefix('{"a": 1 x').text == '{"a": 1'
