"""Behind `mrv2 serve` (127.0.0.1, the embedded tiny model, the qwen3 reasoning parser) with the official `openai`
client and a chat template that opens the thinking: the template-opened thinking streams as `reasoning_content`
exactly as the whole response parses it; min_tokens against a grammar that waits for the thinking (a 400 naming
min_tokens, the grammar's field and the budget only when no output can meet it); and n > 1 choices under the
grammar-after-thinking gate, each thinking and then answering with JSON (or a forced tool call) that validates."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from helpers.serve_helpers import module_server, openai_client
from helpers.thinking_chat import ASK, SCHEMA, THINKING_TEMPLATE, TOOLS

pytestmark = pytest.mark.slow

BUDGET, END_IDS = 3, 4  # the tiny model's tokenizer spells `</think>` in 4 tokens
THINK = {"thinking_token_budget": BUDGET, "chat_template": THINKING_TEMPLATE}

server = module_server("serve.reasoning_parser=qwen3")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=120)


def _exactly(text: str) -> dict:
    return {"regex": "".join(c if c.isalnum() else f"[{c}]" for c in text)}


def _streamed(client, **kwargs) -> dict[int, list[str]]:  # type: ignore[no-untyped-def]
    """Per choice: [reasoning, content, finish_reason] joined over the stream's deltas."""
    got: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            parts = got.setdefault(c.index, ["", "", ""])
            parts[0] += getattr(c.delta, "reasoning_content", None) or ""
            parts[1] += c.delta.content or ""
            parts[2] = c.finish_reason or parts[2]
    return got


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("I add them.\n</think>\n\nIt is 5.", "I add them.", "It is 5."),
        ("<think>I add.</think>It is 5.", "I add.", "It is 5."),  # the model repeats the opening tag
    ],
)
def test_template_opened_thinking_streams_as_reasoning(client, text, reasoning, content):  # type: ignore[no-untyped-def]
    kwargs = dict(
        model="tiny", messages=ASK, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": _exactly(text), "chat_template": THINKING_TEMPLATE},
    )  # fmt: skip
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content)
    assert _streamed(client, **kwargs)[0] == [reasoning, content, "stop"]
    cut = {**kwargs, "max_tokens": 3}  # the tokens run out while thinking: all of it is reasoning
    whole = client.chat.completions.create(**cut).choices[0]
    assert whole.message.reasoning_content and not whole.message.content
    assert _streamed(client, **cut)[0] == [whole.message.reasoning_content, "", "length"]


def test_min_tokens_counts_the_thinking_before_a_grammar(client):  # type: ignore[no-untyped-def]
    boolean = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}
    kwargs = dict(model="tiny", messages=ASK, temperature=0.9, seed=1, response_format=boolean)
    ok = client.chat.completions.create(
        max_tokens=20, extra_body={"min_tokens": BUDGET + END_IDS + 1, **THINK}, **kwargs
    )
    assert ok.choices[0].finish_reason == "stop" and ok.usage.completion_tokens >= BUDGET + END_IDS + 1
    assert isinstance(json.loads(ok.choices[0].message.content), bool) and ok.choices[0].message.reasoning_content
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(max_tokens=60, extra_body={"min_tokens": 40, **THINK}, **kwargs)
    message = err.value.body["message"]  # type: ignore[index]
    assert "response_format.json_schema.schema always ends before min_tokens=40" in message
    assert f"thinking_token_budget={BUDGET}" in message and "SamplingParams" not in message
    # A forced call's grammar is too large for validation's walk to decide (docs/tool_calling.md): a min_tokens past
    # the call is a 400 naming both once the call has ended; one that thinking plus the call can meet runs.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=120, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, extra_body={"min_tokens": 100, **THINK},
        )  # fmt: skip
    message = err.value.body["message"]  # type: ignore[index]
    assert "tool_choice's forced call ended before min_tokens=100" in message and "SamplingParams" not in message
    call = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=70, temperature=0.9, seed=5, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, extra_body={"min_tokens": BUDGET + END_IDS + 8, **THINK},
    )  # fmt: skip
    assert call.choices[0].finish_reason == "tool_calls" and call.usage.completion_tokens >= BUDGET + END_IDS + 8


def test_n_choices_each_think_then_answer_json_that_validates(client):  # type: ignore[no-untyped-def]
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    kwargs = dict(model="tiny", messages=ASK, max_tokens=40, temperature=0.9, seed=3, n=3, response_format=schema)
    whole = client.chat.completions.create(extra_body=THINK, **kwargs)
    assert len(whole.choices) == 3
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3 * (BUDGET + END_IDS)
    for choice in whole.choices:
        assert choice.finish_reason == "stop" and choice.message.reasoning_content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = _streamed(client, extra_body=THINK, **kwargs)
    assert sorted(streamed) == [0, 1, 2]
    for reasoning, content, finish in streamed.values():
        assert reasoning and finish == "stop" and "</think>" not in reasoning + content
        jsonschema.validate(json.loads(content), SCHEMA)


def test_n_choices_each_think_then_make_the_required_call(client):  # type: ignore[no-untyped-def]
    out = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=70, temperature=0.9, seed=5, n=2, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, extra_body=THINK,
    )  # fmt: skip
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content
        (call,) = choice.message.tool_calls
        assert call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
