"""The tool-call parser interface: model output text -> (content, tool calls), whole or as a stream of deltas.

A parser knows one model family's tool-call format. `extract` reads a finished output; `extract_delta` reads it as
it grows and returns OpenAI-shaped `tool_calls` deltas (index, id, type and the function name first, then the
arguments fragment by fragment, as `partial_calls` sees them written). Text that only might be part of a call is
held back, so a partial tag never reaches `content`. Output that looks like a call but does not parse is plain
content: a model's malformed call is its answer (docs/tool_calling.md says what a stream shows then).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Sequence

from framework.entrypoints.tool_parsers.json_prefix import PartialCall


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
        self._sent: list[list[str]] = []  # per announced call: [name, id, arguments sent so far]
        self.calls: list[ToolCall] = []  # the calls of a finished stream, with the ids it announced

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

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of an output still being written, in order, as far as each is certain (the streaming view
        of `extract`). The default knows none: calls then arrive whole when the output ends."""
        return []

    def extract_delta(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, OpenAI `tool_calls` deltas) after the output grew by `delta`; `final` at its end.

        Content streams up to where a call may begin (a marker's possible start is held back); the rest is held.
        A call is announced (index, id, type, name) once `partial_calls` knows its name, and its arguments go out
        as their certain prefix grows, all but the closing brace. At the end `extract` decides: the calls it
        finds get their remaining fragments (the ones never announced come whole); if it finds none, the held
        text is content. A call announced but not found keeps arguments that do not parse."""
        self._text += delta
        text = self._text
        if self._start is None:
            self._start = self.call_start(text)
        if self._start is None:
            end = len(text) if final else len(text) - self.held_back(text)
            return self._release(max(end, self._released)), []
        content = self._release(max(self._start, self._released))
        if final:
            return self._finish(content)
        return content, self._stream(self.partial_calls(text))

    def _release(self, end: int) -> str:
        out, self._released = self._text[self._released : end], end
        return out

    def _announce(self, name: str) -> dict[str, Any]:
        self._sent.append([name, new_call_id(), ""])
        index = len(self._sent) - 1
        return {
            "index": index,
            "id": self._sent[index][1],
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }

    def _grow(self, index: int, arguments: str) -> list[dict[str, Any]]:
        """The fragment taking call `index`'s sent arguments to `arguments` (none unless they extend them)."""
        sent = self._sent[index][2]
        if len(arguments) <= len(sent) or not arguments.startswith(sent):
            return []
        self._sent[index][2] = arguments
        return [{"index": index, "function": {"arguments": arguments[len(sent) :]}}]

    def _stream(self, partials: list[PartialCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(partials):
            if call.name is None:
                break  # calls are announced in order
            if index == len(self._sent):
                deltas.append(self._announce(call.name))
            if self._sent[index][0] == call.name:
                deltas += self._grow(index, _unparsable(call.arguments))
        return deltas

    def _finish(self, content: str) -> tuple[str, list[dict[str, Any]]]:
        _, calls = self.extract(self._text)
        if not calls:  # the call part did not parse: it is content (calls already announced stay unfinished)
            return content + self._release(len(self._text)), []
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if index == len(self._sent):
                deltas.append(self._announce(call.name))
            deltas += self._grow(index, call.arguments)
            self.calls.append(ToolCall(call.name, call.arguments, self._sent[index][1]))
        return content, deltas


def _unparsable(arguments: str) -> str:
    """`arguments` less its closing brace when they are whole: before the output ends (and `extract` confirms the
    call) a streamed call's arguments never parse, so a call the end abandons can be told from one that stands."""
    try:
        json.loads(arguments)
    except ValueError:
        return arguments
    return arguments[:-1]
