"""Agentic chat behind `mrv2 serve` (127.0.0.1, the embedded tiny model, the qwen3 reasoning parser), through the
official `openai` client and LangChain: the thinking budget and its reasoning-token count, the Responses API
(text, reasoning items, forced function calls streamed and not, a two-turn call loop, stateless refusals), and a
LangChain tool-calling loop over two tools that ends. The tiny model never writes `<think>` or a call by itself: a
regex (as a model that knows the format would write) or a forced `tool_choice` stands in."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from helpers.serve_helpers import module_server, openai_client

from framework.entrypoints.chat_output import thinking_budget_for

pytestmark = pytest.mark.slow

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
SCHEMAS = {"add": ADD, "weather": WEATHER}
FLAT_TOOLS = [{"type": "function", "name": n, "description": n, "parameters": s} for n, s in SCHEMAS.items()]
ASK = "add 2 and 3, then tell me the weather in Paris"
END_IDS = 4  # the tiny model's tokenizer spells `</think>` in 4 tokens

server = module_server("serve.reasoning_parser=qwen3")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=300)


def _regex_for(text: str) -> str:
    return "".join(c if c.isalnum() else f"[{c}]" for c in text)


def test_thinking_budget_ends_the_thinking_and_usage_counts_it(client):
    """Without a budget the regex (spelling the thinking, from the first token) lets the model close its thinking
    after any letter; it runs on past 12 tokens by itself. With a budget of 12 the grammar constrains the answer
    only, the thinking runs free and the budget ends it: 12 tokens then the 4 forced `</think>` tokens."""
    regex = {"structured_outputs": {"regex": "[<]think[>][a-z]{1,40}[<][/]think[>][a-z]{1,4}"}}
    answer = {"structured_outputs": {"regex": "[a-z]{1,4}"}}
    ask = [{"role": "user", "content": "think"}]
    free = client.chat.completions.create(model="tiny", messages=ask, max_tokens=80, temperature=0, extra_body=regex)
    budget = client.chat.completions.create(
        model="tiny", messages=ask, max_tokens=80, temperature=0, extra_body={**answer, "thinking_token_budget": 12}
    )
    assert free.usage.completion_tokens_details.reasoning_tokens > 12 + END_IDS  # it thinks longer by itself
    assert budget.usage.completion_tokens_details.reasoning_tokens == 12 + END_IDS
    thought = budget.choices[0].message.reasoning_content
    assert thought and re.fullmatch("[a-z]{1,4}", budget.choices[0].message.content)  # the grammar, after thinking
    streamed = client.chat.completions.create(
        model="tiny",
        messages=ask,
        max_tokens=80,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**answer, "thinking_token_budget": 12},
    )
    reasoning, content, usage = "", "", None
    for chunk in streamed:
        usage = chunk.usage or usage
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    # Under a budget the output starts inside the thinking, streamed as reasoning like the whole parse.
    assert content == budget.choices[0].message.content
    assert reasoning == thought and usage.completion_tokens_details.reasoning_tokens == 12 + END_IDS


def test_a_budget_is_dropped_where_the_template_closed_the_thinking():
    assert thinking_budget_for("<|im_start|>assistant\n<think>\n\n</think>\n\n", 5) is None  # enable_thinking off
    assert thinking_budget_for("<|im_start|>assistant\n<think>\n", 5) == 5  # opened by the template
    assert thinking_budget_for("old <think>x</think> turn; <|im_start|>assistant\n", 5) is None
    assert thinking_budget_for("<|im_start|>assistant\n", 5) == 5


def test_responses_text_with_reasoning_streamed_and_not(client):
    extra = {"structured_outputs": {"regex": _regex_for("<think>plan</think>done")}}
    r = client.responses.create(
        model="tiny", input="hi", instructions="be brief", max_output_tokens=40, extra_body=extra
    )
    assert r.status == "completed" and [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "plan" and r.output_text == "done"
    assert r.usage.output_tokens_details.reasoning_tokens > 0 and r.usage.input_tokens > 0
    with client.responses.stream(
        model="tiny", input="hi", instructions="be brief", max_output_tokens=40, extra_body=extra
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "done" and final.output_text == "done"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    short = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_calls_validate(client, stream):
    kwargs = dict(
        model="tiny",
        input=ASK,
        tools=FLAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
    )
    if stream:
        with client.responses.stream(**kwargs) as events:
            fragments: dict[str, str] = {}
            for e in events:
                if e.type == "response.function_call_arguments.delta":
                    fragments[e.item_id] = fragments.get(e.item_id, "") + e.delta
            r = events.get_final_response()
        assert fragments == {item.id: item.arguments for item in r.output}
    else:
        r = client.responses.create(**kwargs)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.call_id.startswith("call_") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_responses_two_turn_call_loop_and_stateless_refusals(client, server):
    first = client.responses.create(
        model="tiny",
        input=ASK,
        tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=60,
    )
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "add"
    history = [
        {"role": "user", "content": ASK},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
    ]
    final = client.responses.create(
        model="tiny", input=history, tools=FLAT_TOOLS, tool_choice="auto", max_output_tokens=6
    )
    assert [item.type for item in final.output] == ["message"]
    assert final.usage.input_tokens > first.usage.input_tokens  # the call and its result were rendered
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model="tiny", input="hi", store=True, max_output_tokens=2)
    r = server.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = server.post("/v1/responses", json={"input": "hi", "tools": [{"type": "web_search"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_langchain_tool_loop_over_two_tools_ends(server):
    """LangChain's tool-calling pieces (`bind_tools`, tools invoked with the model's calls, `ToolMessage`s back)
    in the usual agent loop: call the model, run its calls, repeat until a reply has none. The tool choice per turn
    (a call to each tool, then none) steers the tiny model, so the loop ends after three model calls."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    tools = {"add": add, "weather": weather}
    llm = langchain_openai.ChatOpenAI(
        model="tiny", base_url=server.base_url, api_key="unused", max_retries=0, max_tokens=40, temperature=0
    )
    choices = [{"type": "function", "function": {"name": "add"}}, "weather", "none"]
    messages: list = [HumanMessage(ASK)]
    ran = []
    for turn in range(5):
        reply = llm.bind_tools(list(tools.values()), tool_choice=choices[min(turn, 2)]).invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(tools[call["name"]].invoke(call))  # a ToolMessage answering that call
            ran.append(call["name"])
    assert not reply.tool_calls and turn == 2  # the loop ended on a reply without calls
    assert ran == ["add", "weather"] and len(messages) == 6
