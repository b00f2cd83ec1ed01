"""`mrv2 serve` (127.0.0.1) on a tiny random gpt-oss checkpoint, with the official `openai` client: chat requests
are rendered in harmony and read by channel, streamed and not. A grammar (`structured_outputs`, special tokens as
llguidance token references) makes the random model write a chosen harmony turn, so the whole path is checked;
unconstrained random outputs and forced calls come back well-formed; a tool loop's second turn renders the tool's
result; bad fields are 400s naming them. The server derives the vocabulary from the checkpoint itself, offline."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from helpers.harmony_models import write_chat_checkpoint, write_vocab
from helpers.serve_helpers import ServerProcess, openai_client
from test_harmony_chat import ASK, TOOLS, TRIP

pytestmark = pytest.mark.slow

ANSWER = "<|channel|>analysis<|message|>Short trip.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
CALL = '<|channel|>commentary to=functions.hotels <|constrain|>json<|message|>{"city": "Rome", "days": 2}<|call|>'


def _grammar(harmony_text: str) -> dict[str, str]:
    import re

    pieces = [p for p in re.split(r"(<\|[a-z_]+\|>)", harmony_text) if p]
    return {"grammar": "start: " + " ".join(p if p.startswith("<|") else json.dumps(p) for p in pieces)}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = tmp_path_factory.mktemp("gpt-oss-chat")
    write_chat_checkpoint(write_vocab(tmp_path_factory.mktemp("o200k")), model)
    with ServerProcess(f"model.path={model}", "model.max_model_len=1024", "serve.served_model_name=gpt-oss") as s:
        yield openai_client(s, timeout=120)


def _streamed(client: Any, **kwargs: Any) -> tuple[str, str, list[dict], str]:
    """reasoning, content, calls (accumulated as the openai client does) and finish_reason of a stream."""
    reasoning, content, calls, finish = "", "", {}, ""  # type: ignore[var-annotated]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_an_answer_by_channel_streamed_and_not(client):
    kwargs = dict(
        model="gpt-oss", messages=ASK, tools=TOOLS, max_tokens=40, extra_body={"structured_outputs": _grammar(ANSWER)}
    )
    r = client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content, message.tool_calls) == ("Short trip.", "Sunny.", None)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens_details.reasoning_tokens > 0
    assert _streamed(client, **kwargs) == ("Short trip.", "Sunny.", [], "stop")


def test_a_call_then_the_tool_result_turn(client):
    kwargs = dict(
        model="gpt-oss", messages=ASK, tools=TOOLS, max_tokens=40, extra_body={"structured_outputs": _grammar(CALL)}
    )
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("hotels", '{"city": "Rome", "days": 2}')
    reasoning, content, calls, finish = _streamed(client, **kwargs)
    assert (content, [(c["name"], c["arguments"]) for c in calls], finish) == (
        "",
        [("hotels", call.function.arguments)],
        "tool_calls",
    )
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3 hotels"},
    ]
    final = client.chat.completions.create(
        model="gpt-oss",
        messages=history,
        tools=TOOLS,
        max_tokens=40,
        extra_body={"structured_outputs": _grammar(ANSWER)},
    )
    assert final.choices[0].message.content == "Sunny."
    assert final.usage.prompt_tokens > r.usage.prompt_tokens + 10  # the call and its result are in the prompt


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_validate(client, stream):
    kwargs = dict(
        model="gpt-oss", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=48, temperature=0.9, seed=2
    )
    if stream:
        _, content, calls, finish = _streamed(client, **kwargs)
        call = calls[0]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        call = {
            "name": choice.message.tool_calls[0].function.name,
            "arguments": choice.message.tool_calls[0].function.arguments,
        }
    assert finish == "tool_calls" and content == "" and call["name"] in ("weather", "hotels")
    jsonschema.validate(json.loads(call["arguments"]), TRIP)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_outputs_are_well_formed(client, seed):
    kwargs = dict(model="gpt-oss", messages=ASK, tools=TOOLS, max_tokens=16, temperature=1.0, seed=seed)
    r = client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert isinstance(message.content, str) or message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    reasoning, content, calls, finish = _streamed(client, **kwargs)  # the same seed: the same tokens
    assert (reasoning or None, content, finish) == (
        message.reasoning_content,
        message.content or "",
        r.choices[0].finish_reason,
    )


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"extra_body": {"thinking_token_budget": 4}}, "thinking_token_budget"),
        ({"extra_body": {"continue_final_message": True, "add_generation_prompt": False}}, "continue_final_message"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ],
)
def test_bad_fields_are_400s_naming_them(client, extra, param):
    kwargs = {"model": "gpt-oss", "messages": ASK, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs)
    assert err.value.body["param"] == param  # type: ignore[index]


def test_responses_api_in_harmony(client):
    """The Responses API on the same machinery: reasoning and message items, a call item; `reasoning.effort` is
    gpt-oss's reasoning level."""
    kwargs = dict(model="gpt-oss", input="Weather?", instructions="Be brief.", max_output_tokens=40)
    r = client.responses.create(
        **kwargs, reasoning={"effort": "low"}, extra_body={"structured_outputs": _grammar(ANSWER)}
    )
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.output_text == "Sunny."
    assert r.output[0].content[0].text == "Short trip." and r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(**kwargs, extra_body={"structured_outputs": _grammar(ANSWER)}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Sunny." and [item.type for item in final.output] == ["reasoning", "message"]
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    call = client.responses.create(**kwargs, tools=flat, extra_body={"structured_outputs": _grammar(CALL)})
    assert [(i.type, i.name, i.arguments) for i in call.output] == [
        ("function_call", "hotels", '{"city": "Rome", "days": 2}')
    ]
    for bad, param in (
        ({"reasoning": {"effort": "minimal"}}, "reasoning.effort"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(**kwargs, **bad)
        assert err.value.body["param"] == param  # type: ignore[index]
