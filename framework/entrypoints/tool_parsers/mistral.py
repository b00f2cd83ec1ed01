"""Mistral tool calls after the `[TOOL_CALLS]` token: a JSON list of `{"name", "arguments"}` objects (tokenizer
v3, Mistral 7B v0.3 / Mixtral), or `name[ARGS]{...}` per call (tokenizer v11 and later, e.g. Mistral Small 3.2)."""

from __future__ import annotations

import json

from framework.entrypoints.tool_parsers.base import ToolCall, ToolParser, arguments_text
from framework.entrypoints.tool_parsers.json_prefix import PartialCall, json_prefix, scan_call_object

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{...}, ...]` or `[TOOL_CALLS]name[ARGS]{...}` (repeated)."""

    name = "mistral"
    start_markers = (TOOL_CALLS,)
    needs_special_tokens = True

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return text, []
        calls: list[ToolCall] = []
        for part in text[start:].split(TOOL_CALLS)[1:]:
            part = part.strip()
            parsed = self._list_form(part) if part.startswith("[") else self._args_form(part)
            if parsed is None:
                return text, []
            calls.extend(parsed)
        return (text[:start], calls) if calls else (text, [])

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        start = text.find(TOOL_CALLS)
        for part in text[start:].split(TOOL_CALLS)[1:] if start >= 0 else []:
            done = _partial_list(part, calls) if part.lstrip().startswith("[") else _partial_args(part, calls)
            if not done:
                break
        return calls

    @staticmethod
    def _list_form(part: str) -> list[ToolCall] | None:
        try:
            items = json.loads(part)
        except ValueError:
            return None
        if isinstance(items, dict):
            items = [items]
        calls = []
        for item in items if isinstance(items, list) else [None]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = arguments_text(item.get("arguments", item.get("parameters", {})))
            if arguments is None:
                return None
            calls.append(ToolCall(item["name"], arguments))
        return calls

    @staticmethod
    def _args_form(part: str) -> list[ToolCall] | None:
        name, sep, rest = part.partition(ARGS)
        arguments = arguments_text(rest.strip()) if sep else None
        if not name.strip() or arguments is None:
            return None
        return [ToolCall(name.strip(), arguments)]


def _partial_list(part: str, calls: list[PartialCall]) -> bool:
    """Adds the calls of a `[{...}, ...]` part written so far; True when the list is closed."""
    pos = part.index("[") + 1
    while True:
        call = scan_call_object(part, pos)
        if call is None:
            return part[pos:].strip().startswith("]")
        calls.append(call)
        if call.end is None:
            return False
        pos = call.end
        while pos < len(part) and part[pos] in " \t\r\n,":
            pos += 1


def _partial_args(part: str, calls: list[PartialCall]) -> bool:
    """Adds the call of a `name[ARGS]{...}` part written so far; True when its arguments are whole."""
    name, sep, _ = part.partition(ARGS)
    if not sep or not name.strip():
        return False
    at = len(name) + len(ARGS)
    value = json_prefix(part, at)
    object_args = part[at:].lstrip().startswith("{")
    calls.append(PartialCall(name.strip(), value.text if object_args else "", value.end))
    return value.end is not None
