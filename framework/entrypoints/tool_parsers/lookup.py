"""Tool-call parsers by name: the registry (`mrv2.tool_parsers` entry points included) and detection of the format
a chat template writes."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from framework.config.registry import TOOL_PARSERS
from framework.entrypoints.tool_parsers.base import ToolParser
from framework.params.request_errors import InvalidRequestError


def tool_parser_class(name: str) -> type[ToolParser]:
    """The registered parser class; an unknown name raises `InvalidRequestError` listing the known ones."""
    if name not in TOOL_PARSERS:
        raise InvalidRequestError(f"unknown tool-call parser {name!r}; registered: {', '.join(TOOL_PARSERS.names())}")
    return TOOL_PARSERS.get(name)  # type: ignore[no-any-return]


def make_tool_parser(name: str, tools: Optional[Sequence[Mapping[str, Any]]] = None) -> ToolParser:
    """A fresh parser (one per generated sequence) of the registered format `name`."""
    return tool_parser_class(name)(tools)


def detect_tool_parser(template_source: str) -> Optional[str]:
    """The format a chat template writes tool calls in, when its text says so unambiguously (else None)."""
    if "<function=" in template_source and "<parameter=" in template_source:
        return "qwen3_coder"
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|python_tag|>" in template_source or ('"parameters"' in template_source and "ipython" in template_source):
        return "llama3_json"
    return None
