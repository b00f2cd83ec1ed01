"""The tool-call parser interface: model output text -> (content, tool calls), whole or as a stream of deltas.

A parser knows one model family's tool-call format. `extract` reads a finished output; `extract_delta` reads it as
it grows and returns OpenAI-shaped `tool_calls` deltas (index, id, type and the function name first, then the
arguments). Text that only might be the start of a call is held back, so a partial tag never reaches `content`.
Output that looks like a call but does not parse is plain content: a model's malformed call is its answer.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Sequence


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (what OpenAI sends)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parameter_schemas(tools: Optional[Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Function name -> its JSON-schema `parameters`, from OpenAI tool definitions."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function", tool)
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            schemas[function["name"]] = dict(params) if isinstance(params, Mapping) else {}
    return schemas


def arguments_text(arguments: Any) -> Optional[str]:
    """Arguments as JSON text: a JSON object, or JSON text of one; None when they are neither."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


class ToolParser(ABC):
    """One model family's tool-call format. One instance per generated sequence (streaming keeps state here).

    Subclasses set `name` (the registry name), `start_markers` (text that opens the tool-call part of an output)
    and implement `extract`. `tools` are the request's OpenAI tool definitions (formats whose arguments are not
    JSON convert values by the parameter schemas)."""

    name: ClassVar[str] = ""
    start_markers: ClassVar[tuple[str, ...]] = ()
    needs_special_tokens: ClassVar[bool] = False  # its markers are special tokens: the text must keep them

    def __init__(self, tools: Optional[Sequence[Mapping[str, Any]]] = None) -> None:
        self.schemas = parameter_schemas(tools)
        self._text = ""
        self._released = 0  # characters of `_text` given out as content
        self._start: Optional[int] = None  # where the tool-call part begins, once seen
        self._emitted = 0  # calls streamed so far
        self.calls: list[ToolCall] = []  # every call streamed so far (ids included)

    @abstractmethod
    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished output; a malformed call part gives `(text, [])`."""

    def call_start(self, text: str) -> Optional[int]:
        """Where the tool-call part of `text` begins (None: not seen yet)."""
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` may be the start of a marker (not to be shown yet)."""
        longest = 0
        for marker in self.start_markers:
            for size in range(min(len(marker) - 1, len(text)), longest, -1):
                if text.endswith(marker[:size]):
                    longest = size
                    break
        return longest

    def extract_delta(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, OpenAI `tool_calls` deltas) after the output grew by `delta`; `final` at its end."""
        self._text += delta
        text = self._text
        if self._start is None:
            self._start = self.call_start(text)
        if self._start is None:
            end = len(text) if final else len(text) - self.held_back(text)
            return self._release(max(end, self._released)), []
        content = self._release(max(self._start, self._released))
        _, calls = self.extract(text)
        if final and not calls and not self._emitted:  # the call part did not parse: it is content
            return content + self._release(len(text)), []
        return content, self._stream_calls(calls)

    def _release(self, end: int) -> str:
        out, self._released = self._text[self._released : end], end
        return out

    def _stream_calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for call in calls[self._emitted :]:
            index = self._emitted
            self._emitted += 1
            self.calls.append(call)
            deltas.append(
                {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            )
            deltas.append({"index": index, "function": {"arguments": call.arguments}})
        return deltas
