"""Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (Meta's JSON-based tool
calling for 3.1 / 3.2 / 3.3), optionally after `<|python_tag|>`, several calls separated by `;`."""

from __future__ import annotations

import json
from typing import Optional

from framework.entrypoints.tool_parsers.base import ToolCall, ToolParser, arguments_text
from framework.entrypoints.tool_parsers.json_prefix import PartialCall, scan_call_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """An answer that is one or more JSON call objects; anything else is content."""

    name = "llama3_json"
    start_markers = (PYTHON_TAG,)
    needs_special_tokens = True

    def call_start(self, text: str) -> Optional[int]:
        stripped = text.lstrip()
        if stripped.startswith("{"):
            return len(text) - len(stripped)
        return super().call_start(text)

    def held_back(self, text: str) -> int:
        if not text.strip():
            return len(text)  # leading whitespace: a call may still come
        return super().held_back(text)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        start = self.call_start(text)
        if start is None:
            return text, []
        body = text[start:]
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        body = body.strip()
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            arguments = arguments_text(obj.get("parameters", obj.get("arguments", {})))
            if arguments is None:
                return text, []
            calls.append(ToolCall(obj["name"], arguments))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return (text[:start], calls) if calls else (text, [])

    def partial_calls(self, text: str) -> list[PartialCall]:
        start = self.call_start(text)
        if start is None:
            return []
        pos = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
        calls: list[PartialCall] = []
        while True:
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            call = scan_call_object(text, pos, ("parameters", "arguments"))
            if call is None:
                return calls
            calls.append(call)
            if call.end is None:
                return calls
            pos = call.end
