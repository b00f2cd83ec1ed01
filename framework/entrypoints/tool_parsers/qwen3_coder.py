"""Qwen3-Coder tool calls: XML-style functions inside `<tool_call>` blocks,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; they become JSON by the function's parameter schema (a string parameter stays text,
others are read as JSON where they parse), as the format's own chat template writes them."""

from __future__ import annotations

import json
import re
from typing import Any

from framework.entrypoints.tool_parsers.base import ToolCall, ToolParser
from framework.entrypoints.tool_parsers.json_prefix import PartialCall

_BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|\Z)", re.DOTALL)
_HEADER = re.compile(r"<tool_call>\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _trim_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _convert(value: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value  # untyped or unparsable: the text itself


class Qwen3CoderToolParser(ToolParser):
    """`<tool_call><function=name><parameter=p>v</parameter>...</function></tool_call>`."""

    name = "qwen3_coder"
    start_markers = ("<tool_call>",)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for match in _BLOCK.finditer(text, start):
            name = match.group(1).strip()
            properties = self.schemas.get(name, {}).get("properties", {})
            arguments = {
                p.group(1).strip(): _convert(_trim_newline(p.group(2)), properties.get(p.group(1).strip()))
                for p in _PARAM.finditer(match.group(2))
            }
            if not name:
                return text, []
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return text, []
        return text[:start], calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """A call is named once its `<function=...>` is; its arguments grow by each closed parameter."""
        calls: list[PartialCall] = []
        for header in _HEADER.finditer(text):
            name = header.group(1).strip()
            close = text.find("</function>", header.end())
            body = text[header.end() : close if close >= 0 else len(text)]
            properties = self.schemas.get(name, {}).get("properties", {})
            pairs = []
            for p in _PARAM.finditer(body):
                closed = close >= 0 or p.group(0).endswith("</parameter>") or p.end() < len(body)
                if not closed:
                    break
                key = p.group(1).strip()
                value = _convert(_trim_newline(p.group(2)), properties.get(key))
                pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            arguments = "{" + ", ".join(pairs) + ("}" if close >= 0 else "")
            calls.append(PartialCall(name, arguments, close + len("</function>") if close >= 0 else None))
            if close < 0:
                break
        return calls
