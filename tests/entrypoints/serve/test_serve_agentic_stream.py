"""Behind `mrv2 serve` (127.0.0.1, the embedded tiny model, the qwen3 reasoning parser), with the official `openai`
client and LangChain: tool calls streamed token by token (forced calls, canned Hermes outputs including parallel,
malformed and cut ones, each equal to the same request not streamed), a JSON schema under a thinking budget with
a template that thinks, and the Responses API's logprobs and `reasoning.effort` (with their 400s)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from helpers.serve_helpers import module_server, openai_client

pytestmark = pytest.mark.slow

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add", "parameters": ADD}}]
ASK = [{"role": "user", "content": "add 2 and 3"}]
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{ '# ' + m['role'] + ':\\n# ' + m['content'] + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '# assistant:\\n<think>\\n' }}{%- endif %}"
)
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
CANNED = [
    "ok" + CALL + CALL.replace('"a": 2', '"b": 7'),  # parallel calls: index 0 and 1
    'ok<tool_call>{"name": "add", "arguments": {"a": </tool_call>',  # malformed: content
]
END_IDS = 4  # the tiny model's tokenizer spells `</think>` in 4 tokens

server = module_server("serve.reasoning_parser=qwen3")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=300)


def _exactly(text: str) -> dict:
    return {"structured_outputs": {"regex": "".join(c if c.isalnum() else f"[{c}]" for c in text)}}


def _both(client, **kwargs):  # type: ignore[no-untyped-def]
    """The same request whole and through the client's streaming helper: (completion, final, argument deltas)."""
    whole = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, **kwargs)
    fragments = []
    with client.chat.completions.stream(model="tiny", messages=ASK, temperature=0, **kwargs) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append((event.index, event.arguments_delta))
        final = stream.get_final_completion()
    return whole.choices[0], final.choices[0], fragments


def _calls(message):  # type: ignore[no-untyped-def]
    """The calls that stand: a streamed call the output abandoned keeps arguments that do not parse."""
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or [] if _parses(c.function.arguments)]


def _parses(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def test_forced_calls_stream_fragment_by_fragment(client):
    choice = {"type": "function", "function": {"name": "add"}}
    whole, streamed, fragments = _both(client, tools=TOOLS, tool_choice=choice, max_tokens=40)
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    assert _calls(streamed.message) == _calls(whole.message) and len(fragments) >= 3
    jsonschema.validate(json.loads(streamed.message.tool_calls[0].function.arguments), ADD)


@pytest.mark.parametrize("text", CANNED)
def test_canned_hermes_outputs_stream_as_they_parse_whole(client, text):
    whole, streamed, fragments = _both(client, tools=TOOLS, max_tokens=60, extra_body=_exactly(text))
    assert (streamed.message.content or None) == (whole.message.content or None)
    assert _calls(streamed.message) == _calls(whole.message) and streamed.finish_reason == whole.finish_reason
    assert {i for i, _ in fragments} == set(range(len(streamed.message.tool_calls or [])))


def test_a_call_cut_by_max_tokens_is_content_and_its_fragments_never_parse(client):
    kwargs = dict(model="tiny", messages=ASK, temperature=0, tools=TOOLS, max_tokens=12, extra_body=_exactly(CALL))
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            calls[d.index] = calls.get(d.index, "") + (d.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert whole.finish_reason == finish == "length" and whole.message.tool_calls is None
    assert content == whole.message.content and content.startswith("<tool_call>")
    assert not any(_parses(arguments) for arguments in calls.values())  # announced before the cut: never parse


def test_langchain_streamed_tool_call_chunks_reassemble(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model="tiny", base_url=server.base_url, api_key="unused", max_retries=0, max_tokens=40, temperature=0
    )
    bound = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    chunks = list(bound.stream("add 2 and 3"))
    assert sum(1 for c in chunks if c.tool_call_chunks) >= 3  # the arguments arrive in pieces
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    whole = bound.invoke("add 2 and 3")
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    jsonschema.validate(merged.tool_calls[0]["args"], ADD)


@pytest.mark.parametrize("stream", [False, True])
def test_schema_after_thinking_under_a_budget(client, stream):
    schema = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD}}
    kwargs = dict(
        model="tiny",
        messages=ASK,
        max_tokens=30,
        temperature=0.9,
        seed=7,
        response_format=schema,
        extra_body={"thinking_token_budget": 3, "chat_template": THINKING_TEMPLATE},
    )
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)  # the template opened the thinking: no tag in either
        assert "</think>" not in thought + content
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        content, thought = message.content, message.reasoning_content
    assert thought  # the thinking ran free, then the budget closed it
    jsonschema.validate(json.loads(content), ADD)


def test_responses_logprobs_whole_and_streamed(client):
    kwargs = dict(
        model="tiny", input="hi", max_output_tokens=8, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"], extra_body={"structured_outputs": {"regex": "[a-z]{2,4}"}},
    )  # fmt: skip
    r = client.responses.create(**kwargs)
    part = r.output[-1].content[0]
    assert part.logprobs and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    with client.responses.stream(**kwargs) as stream:
        streamed = [lp for e in stream if e.type == "response.output_text.delta" for lp in e.logprobs]
        final = stream.get_final_response()
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in part.logprobs]
    assert final.output[-1].content[0].logprobs == part.logprobs
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=2, top_logprobs=2)
    assert not plain.output[-1].content[0].logprobs  # as OpenAI: only with `include`


def test_reasoning_effort_sets_the_thinking_budget(client):
    none = client.responses.create(model="tiny", input="hi", max_output_tokens=6, reasoning={"effort": "none"})
    assert none.usage.output_tokens_details.reasoning_tokens == END_IDS  # thinking ended at once
    free = client.responses.create(model="tiny", input="hi", max_output_tokens=6, reasoning={"effort": "high"})
    assert free.usage.output_tokens_details.reasoning_tokens == 6  # 8192 tokens never reached: all of it thinking


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"include": ["bogus"]}, "include"),
    ],
)
def test_responses_bad_values_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body=extra)
    assert err.value.status_code == 400 and err.value.body["param"] == param
