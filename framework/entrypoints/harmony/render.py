"""OpenAI chat messages -> a harmony conversation -> the prompt's token ids, rendered by openai-harmony.

How the OpenAI roles map (as gpt-oss's own chat template maps them):

- the harmony **system** message is harmony's own: model identity, knowledge cutoff, today's date, `Reasoning:
  low|medium|high` (`reasoning_effort`, default medium) and the channels;
- OpenAI **system** and **developer** messages before the first other message become the **developer** message's
  `# Instructions` (joined by blank lines), with the request's functions as its `functions` tool namespace
  (`tool_choice` none: no tools); a later system or developer message is a developer message in its place;
- **user** -> user; **assistant** -> its `reasoning_content` as an `analysis` message, its content as a `final`
  message (a `commentary` preamble when it also calls tools), each of its `tool_calls` as a `commentary` message
  to `functions.<name>` with JSON arguments; **tool** -> a message from `functions.<name>` to the assistant, the
  name found by its `tool_call_id` among the earlier calls (or its `name`).

The conversation ends with `<|start|>assistant`, the turn the model writes. Earlier turns' analysis is dropped as
harmony drops it (kept only in a turn that is still calling tools).
"""

from __future__ import annotations

import json
from datetime import date
from typing import Any, Mapping, Optional, Sequence

from framework.entrypoints.chat_template import normalize_messages
from framework.entrypoints.tool_calls import ToolSetup
from framework.params.request_errors import InvalidRequestError

EFFORTS = ("low", "medium", "high")


def reasoning_level(value: Any) -> Any:
    """openai-harmony's `ReasoningEffort` of a request's `reasoning_effort` (None: medium); `InvalidRequestError`
    for another value."""
    from openai_harmony import ReasoningEffort

    if value is None:
        return ReasoningEffort.MEDIUM
    if not isinstance(value, str) or value.lower() not in EFFORTS:
        raise InvalidRequestError(f"reasoning_effort={value!r} is invalid for gpt-oss: must be one of {EFFORTS}")
    return ReasoningEffort(value.lower().capitalize())


def _parameters(schema: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """A function's parameters schema; None for one without parameters, which harmony writes `() => any`."""
    return None if schema.get("type", "object") == "object" and not schema.get("properties") else dict(schema)


def _developer(instructions: list[str], tools: ToolSetup) -> Any:
    from openai_harmony import DeveloperContent, ToolDescription

    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions("\n\n".join(instructions))
    if tools.active:
        content = content.with_function_tools(
            [
                ToolDescription.new(f["name"], f.get("description") or "", parameters=_parameters(f["parameters"]))
                for f in (t["function"] for t in tools.tools)
            ]
        )
    return content


def _assistant(message: Mapping[str, Any], raw: Any, call_names: dict[str, str]) -> list[Any]:
    """`raw`: the message as sent, whose calls' `arguments` JSON text goes into the prompt as the client wrote it."""
    from openai_harmony import Message, Role

    out = []
    if message.get("reasoning_content"):
        out.append(Message.from_role_and_content(Role.ASSISTANT, message["reasoning_content"]).with_channel("analysis"))
    calls = message.get("tool_calls") or []
    if message["content"]:
        channel = "commentary" if calls else "final"
        out.append(Message.from_role_and_content(Role.ASSISTANT, message["content"]).with_channel(channel))
    raw_calls = raw.get("tool_calls") if isinstance(raw, Mapping) else None
    for j, call in enumerate(calls):
        function = call["function"]
        call_names[str(call.get("id", ""))] = function["name"]
        sent = raw_calls[j]["function"].get("arguments") if raw_calls else None
        text = sent if isinstance(sent, str) and sent.strip() else json.dumps(function["arguments"], ensure_ascii=False)
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, text)
            .with_channel("commentary")
            .with_recipient(f"functions.{function['name']}")
            .with_content_type("<|constrain|>json")
        )
    return out


def _tool_result(message: Mapping[str, Any], call_names: dict[str, str], where: str) -> Any:
    from openai_harmony import Author, Message, Role

    name = call_names.get(str(message.get("tool_call_id", ""))) or message.get("name")
    if not name:
        raise InvalidRequestError(
            f"{where}: a tool message needs the tool_call_id of an earlier assistant tool call (or a name): harmony "
            "writes the result as coming from that function"
        )
    author = Author.new(Role.TOOL, f"functions.{name}")
    return (
        Message.from_author_and_content(author, message["content"])
        .with_channel("commentary")
        .with_recipient("assistant")
    )


def conversation(
    messages: Sequence[Any],
    tools: ToolSetup,
    reasoning_effort: Optional[str] = None,
    today: Optional[str] = None,
) -> Any:
    """The harmony `Conversation` of OpenAI `messages` (see the module docstring); raises `InvalidRequestError`
    naming a message it cannot render. `today` (YYYY-MM-DD) defaults to the local date."""
    from openai_harmony import Conversation, Message, Role, SystemContent

    clean = normalize_messages(messages)
    system = SystemContent.new().with_reasoning_effort(reasoning_level(reasoning_effort))
    system = system.with_conversation_start_date(today or date.today().isoformat())
    lead = 0
    while lead < len(clean) and clean[lead]["role"] in ("system", "developer"):
        lead += 1
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = [m["content"] for m in clean[:lead] if m["content"]]
    if instructions or tools.active:
        out.append(Message.from_role_and_content(Role.DEVELOPER, _developer(instructions, tools)))
    call_names: dict[str, str] = {}
    for i, message in enumerate(clean[lead:], start=lead):
        role = message["role"]
        if role in ("system", "developer"):
            out.append(Message.from_role_and_content(Role.DEVELOPER, _developer([message["content"]], ToolSetup())))
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, message["content"]))
        elif role == "assistant":
            out += _assistant(message, messages[i], call_names)
        else:
            out.append(_tool_result(message, call_names, f"messages[{i}]"))
    return Conversation.from_messages(out)


def render_prompt(
    encoding: Any,
    messages: Sequence[Any],
    tools: ToolSetup,
    reasoning_effort: Optional[str] = None,
    today: Optional[str] = None,
) -> list[int]:
    """The prompt's token ids: the conversation, then `<|start|>assistant` for the model's turn."""
    from openai_harmony import HarmonyError, Role

    try:
        return list(
            encoding.render_conversation_for_completion(
                conversation(messages, tools, reasoning_effort, today), Role.ASSISTANT
            )
        )
    except HarmonyError as err:
        raise InvalidRequestError(f"openai-harmony could not render these messages: {err}") from None
