"""Mistral tool calls after the `[TOOL_CALLS]` token: a JSON list of `{"name", "arguments"}` objects (tokenizer
v3, Mistral 7B v0.3 / Mixtral), or `name[ARGS]{...}` per call (tokenizer v11 and later, e.g. Mistral Small 3.2)."""

from __future__ import annotations

import json

from framework.entrypoints.tool_parsers.base import ToolCall, ToolParser, arguments_text

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
