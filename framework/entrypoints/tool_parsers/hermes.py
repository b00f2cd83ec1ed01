"""Hermes / Qwen 2.5 / Qwen 3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
call, text before the first block is content (NousResearch's Hermes function-calling format, which Qwen's chat
templates use)."""

from __future__ import annotations

import json
import re

from framework.entrypoints.tool_parsers.base import ToolCall, ToolParser, arguments_text
from framework.entrypoints.tool_parsers.json_prefix import PartialCall, scan_call_object

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_call_object(body: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (or `"parameters"`) as a call; None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = arguments_text(obj.get("arguments", obj.get("parameters", {})))
    return None if arguments is None else ToolCall(obj["name"], arguments)


class HermesToolParser(ToolParser):
    """`<tool_call>` blocks of JSON. A last block the model did not close still counts when its JSON is whole, and
    is dropped when it is cut off after whole calls; text after the first block that is no block is dropped."""

    name = "hermes"
    start_markers = (OPEN,)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(OPEN)
        if start < 0:
            return text, []
        calls = []
        for match in _BLOCK.finditer(text, start):
            call = parse_call_object(match.group(1).strip())
            if call is None and calls and not match.group(0).endswith(CLOSE):
                break  # a last call cut off (max_tokens): the whole ones before it stand
            if call is None:
                return text, []
            calls.append(call)
        return text[:start], calls  # text after the calls is dropped: a stream has sent the calls by then

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        start = text.find(OPEN)
        while start >= 0:
            call = scan_call_object(text, start + len(OPEN))
            if call is None:
                break
            calls.append(call)
            if call.end is None:
                break
            start = text.find(OPEN, call.end)
        return calls
