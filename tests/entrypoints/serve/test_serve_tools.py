"""Tool calling and reasoning behind `mrv2 serve` (127.0.0.1, the embedded tiny model), through the official
`openai` client and LangChain: forced calls (`required`, named) always parse and validate against the function's
schema; `auto` parses the model's own call text (forced here with a regex, since the tiny model never writes one);
streams carry OpenAI-shaped tool-call deltas and never a piece of a `<tool_call>` tag as content."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.serve_helpers import module_server, openai_client

pytestmark = pytest.mark.slow

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
    "additionalProperties": False,
}
SCHEMAS = {"add": ADD, "weather": WEATHER}
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": s}} for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "add 2 and 3, then tell me the weather in Paris"}]
CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

server = module_server("serve.reasoning_parser=qwen3")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=300)


def _regex_for(text: str) -> dict:
    """An extra body that makes the tiny model write exactly `text` (as a model that knows the format would)."""
    return {"structured_outputs": {"regex": "".join(c if c.isalnum() else f"[{c}]" for c in text)}}


def _validate(calls) -> None:  # type: ignore[no-untyped-def]
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _assemble(stream):  # type: ignore[no-untyped-def]
    """Content, calls ({index: [id, name, arguments]}) and the finish reason of a streamed reply."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.function.name  # id, type and name come first
                    calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    calls[d.index][2] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, calls, reason


def test_required_calls_always_validate(client):  # type: ignore[no-untyped-def]
    for seed in range(2):
        r = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=0.9,
            seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _validate(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1 and not choice.message.content


def test_named_call_streamed_and_not(client):  # type: ignore[no-untyped-def]
    named = {"type": "function", "function": {"name": "weather"}}
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["weather"]
    _validate(r.choices[0].message.tool_calls)
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60, stream=True, temperature=0
    )
    content, calls, reason = _assemble(stream)
    assert content == "" and reason == "tool_calls" and list(calls) == [0]
    assert calls[0][1] == "weather" and json.loads(calls[0][2]) == json.loads(
        r.choices[0].message.tool_calls[0].function.arguments
    )


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_call_text(client, stream):  # type: ignore[no-untyped-def]
    text = "Sure.\n" + CALL_TEXT + CALL_TEXT.replace('"a": 2', '"a": 7')
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=150, stream=stream, extra_body=_regex_for(text)
    )
    if stream:
        content, calls, reason = _assemble(r)
        arguments = [json.loads(calls[i][2]) for i in sorted(calls)]
        assert sorted(calls) == [0, 1] and len({c[0] for c in calls.values()}) == 2  # distinct ids
    else:
        content, reason = r.choices[0].message.content, r.choices[0].finish_reason
        arguments = [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert content == "Sure.\n" and reason == "tool_calls"
    assert arguments == [{"a": 2, "b": 3}, {"a": 7, "b": 3}]


def test_auto_without_a_call_is_content_and_none_renders_no_tools(client, server):  # type: ignore[no-untyped-def]
    text = "x = 1 < 2"  # a '<' that is not a tag: held back, then shown
    content, calls, reason = _assemble(
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, stream=True, extra_body=_regex_for(text)
        )
    )
    assert (content, calls, reason) == (text, {}, "stop")
    with_tools = server.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 1})
    none = server.post(
        "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}
    )
    assert with_tools.json()["usage"]["prompt_tokens"] > none.json()["usage"]["prompt_tokens"]  # tools rendered


def test_a_schema_the_grammar_cannot_compile_is_a_400_naming_tools(server):  # type: ignore[no-untyped-def]
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "uniqueItems": True}}}]
    r = server.post(
        "/v1/chat/completions", json={"messages": ASK, "tools": bad, "tool_choice": "required", "max_tokens": 4}
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("request"), r.text
    assert "tools: a function's parameters schema does not compile" in r.json()["error"]["message"]


def test_two_turn_tool_loop(client):  # type: ignore[no-untyped-def]
    first = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=60,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None  # auto: no call
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered


def test_legacy_functions(client):  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        functions=[t["function"] for t in TOOLS],
        function_call={"name": "add"},
        max_tokens=60,
    )
    assert r.choices[0].finish_reason == "function_call"
    jsonschema.validate(json.loads(r.choices[0].message.function_call.arguments), ADD)


def test_reasoning_content(client):  # type: ignore[no-untyped-def]
    text = "<think>add them</think>five"
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, extra_body=_regex_for(text))
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("add them", "five")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=60, stream=True, extra_body=_regex_for(text)
    ):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
        content += (delta.content or "") if delta else ""
    assert (reasoning.strip(), content) == ("add them", "five")


def test_langchain_bind_tools_required(server):  # type: ignore[no-untyped-def]
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model="tiny",
        base_url=server.base_url,
        api_key="unused",
        max_retries=0,
        max_tokens=60,
        temperature=0,
        timeout=300,
    )
    reply = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke("add 2 and 3")
    assert reply.tool_calls and not reply.invalid_tool_calls
    for call in reply.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
