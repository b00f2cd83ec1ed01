"""Tool-call parsers: a model's tool-call text -> OpenAI `tool_calls`, one registered parser per format.

Built in: `hermes` (Hermes / Qwen `<tool_call>{json}</tool_call>`), `qwen3_coder` (Qwen3-Coder's XML functions),
`llama3_json` (Llama 3.x `{"name": ..., "parameters": ...}`), `mistral` (`[TOOL_CALLS]`). A third party adds one
by subclassing `ToolParser` and declaring it in the `mrv2.tool_parsers` entry-point group.
"""

from __future__ import annotations

from framework.entrypoints.tool_parsers.base import ToolCall, ToolParser, new_call_id, parameter_schemas
from framework.entrypoints.tool_parsers.lookup import detect_tool_parser, make_tool_parser, tool_parser_class

__all__ = [
    "ToolCall",
    "ToolParser",
    "detect_tool_parser",
    "make_tool_parser",
    "new_call_id",
    "parameter_schemas",
    "tool_parser_class",
]
