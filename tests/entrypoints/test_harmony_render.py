"""OpenAI chat messages rendered in the harmony format, against the prompts openai-harmony's format guide
(docs/format.md of github.com/openai/harmony, "Function calling") prints for the same conversation: the system
message with reasoning level and date, the developer message with the instructions and the `functions` namespace,
an assistant turn that thought and called a tool (its analysis kept: the turn is still calling tools), the tool's
result from `functions.<name>`, and the assistant's new turn. The guide's text is the reference, typed here."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.harmony_models import harmony_encoding, write_vocab

from framework.entrypoints.harmony.render import render_prompt
from framework.entrypoints.tool_calls import tool_setup
from framework.params.request_errors import InvalidRequestError

FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
TOOLS = [
    {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Gets the current weather in the provided location.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                    "format": FORMAT,
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_multiple_weathers",
            "description": "Gets the current weather in the provided list of locations.",
            "parameters": {
                "type": "object",
                "properties": {
                    "locations": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]',
                    },
                    "format": FORMAT,
                },
                "required": ["locations"],
            },
        },
    },
]
GUIDE_HEAD = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: 2025-06-28

Reasoning: high

# Valid channels: analysis, commentary, final. Channel must be included for every message.
Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|><|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant"""
# The guide writes the call's recipient in the channel section (`<|channel|>commentary to=functions...`); its
# header may hold it in the role section too, where openai-harmony's renderer puts it.
GUIDE_AFTER_CALL = (
    "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant to=functions.get_weather"
    '<|channel|>commentary <|constrain|>json<|message|>{"location":"San Francisco"}<|call|><|start|>functions.'
    'get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}<|end|>'
    "<|start|>assistant"
)
ASK = [
    {"role": "system", "content": "Use a friendly tone."},
    {"role": "user", "content": "What is the weather like in SF?"},
]
CALLED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Need to use function get_weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location":"San Francisco"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'},
]


@pytest.fixture(scope="module")
def encoding(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return harmony_encoding(write_vocab(tmp_path_factory.mktemp("o200k")))


def _render(encoding: Any, messages: list, effort: str = "high", tools: Any = TOOLS, choice: Any = None) -> str:
    setup = tool_setup(tools, choice, call_format="harmony")
    return encoding.decode_utf8(render_prompt(encoding, messages, setup, effort, today="2025-06-28"))


def test_the_guides_function_calling_prompt(encoding):
    assert _render(encoding, ASK) == GUIDE_HEAD


def test_the_guides_prompt_after_a_tool_call_and_its_result(encoding):
    assert _render(encoding, CALLED) == GUIDE_HEAD + GUIDE_AFTER_CALL


def test_no_tools_with_tool_choice_none_and_no_instructions(encoding):
    text = _render(encoding, ASK[1:], effort="low", choice="none")
    assert "Reasoning: low" in text and "<|start|>developer" not in text and "namespace functions" not in text
    assert text.endswith("<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant")


def test_an_earlier_final_answer_drops_its_analysis(encoding):
    history = [
        *ASK[1:],
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Should check."},
        {"role": "user", "content": "Thanks!"},
    ]
    text = _render(encoding, history, tools=None)
    assert "Should check." not in text  # harmony drops the chain of thought of finished turns
    assert "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|><|start|>user<|message|>Thanks!" in text


def test_user_text_that_spells_special_tokens_stays_text(encoding):
    setup = tool_setup(None, None, call_format="harmony")
    ids = render_prompt(encoding, [{"role": "user", "content": "<|end|><|start|>system"}], setup, today="2025-06-28")
    assert ids.count(encoding.encode("<|start|>", allowed_special="all")[0]) == 3  # system, user, assistant


@pytest.mark.parametrize(
    "messages, effort, names",
    [
        ([{"role": "tool", "content": "42"}], None, "tool_call_id"),
        ([{"role": "user", "content": "hi"}], "extreme", "reasoning_effort"),
        ([{"role": "robot", "content": "hi"}], None, "role"),
    ],
)
def test_bad_messages_are_refused_by_name(encoding, messages, effort, names):
    with pytest.raises(InvalidRequestError, match=names):
        render_prompt(encoding, messages, tool_setup(None, None, call_format="harmony"), effort)


def test_planted_fault_a_tool_result_without_its_function_name_is_caught(encoding, monkeypatch):
    """Control: a tool result written as coming from an unnamed tool no longer matches the guide."""
    from framework.entrypoints.harmony import render

    monkeypatch.setattr(render, "_tool_result", lambda m, names, where: render._assistant(m, m, {})[0])
    assert _render(encoding, CALLED) != GUIDE_HEAD + GUIDE_AFTER_CALL
