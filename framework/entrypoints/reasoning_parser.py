"""Reasoning parsers: a reasoning model's output -> (reasoning, answer), whole or as a stream of deltas.

The built-in `ThinkReasoningParser` (registered as `think`, `qwen3` and `deepseek_r1`) reads the
`<think>...</think>` section Qwen3 and DeepSeek-R1 write. A template that opens `<think>` itself (DeepSeek-R1, Qwen3
thinking variants) leaves only `...</think>answer` in the output, so an output that has `</think>` is reasoning up
to it whether or not it opened one; an output without `</think>` is reasoning only when it opened `<think>` (it
ran out of tokens thinking), else all answer (thinking was off). A third party registers another in the
`mrv2.reasoning_parsers` entry-point group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from framework.config.registry import REASONING_PARSERS
from framework.params.request_errors import InvalidRequestError


class ReasoningParser(ABC):
    """One reasoning format; one instance per generated sequence (streaming keeps state here)."""

    name: ClassVar[str] = ""

    @abstractmethod
    def extract(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a finished output."""

    @abstractmethod
    def extract_delta(self, delta: str, final: bool) -> tuple[str, str]:
        """(reasoning delta, answer delta) after the output grew by `delta`; `final` at its end."""


def _partial_suffix(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ThinkReasoningParser(ReasoningParser):
    """`<think>reasoning</think>answer` (the opening tag optional, see the module docstring)."""

    name = "think"
    start, end = "<think>", "</think>"
    opened_by_template: ClassVar[bool] = False  # True: the output starts inside the thinking section

    def __init__(self) -> None:
        self._text = ""
        self._released = 0  # characters of `_text` given out (reasoning or answer)
        self._in_answer = False
        self._opened = self.opened_by_template  # inside the thinking section (its opening tag skipped)
        self._started = {False: False, True: False}  # leading whitespace of reasoning / answer is dropped

    def extract(self, text: str) -> tuple[str, str]:
        stripped = text.lstrip()
        cut = text.find(self.end)
        if cut >= 0:
            reasoning = text[:cut].lstrip()
            if reasoning.startswith(self.start):
                reasoning = reasoning[len(self.start) :]
            return reasoning.strip(), text[cut + len(self.end) :].lstrip()
        if stripped.startswith(self.start):
            return stripped[len(self.start) :].strip(), ""
        return "", text

    def extract_delta(self, delta: str, final: bool) -> tuple[str, str]:
        self._text += delta
        text = self._text
        if self._in_answer:
            return "", self._take(len(text), answer=True)
        stripped = text.lstrip()
        if not self._opened:
            if not stripped.startswith(self.start):
                if final or (stripped and not self.start.startswith(stripped)):
                    self._in_answer = self._started[True] = True  # no thinking section: all of it is the answer
                    return "", self._take(len(text), answer=True)
                return "", ""  # may still become `<think>`
            self._released, self._opened = len(text) - len(stripped) + len(self.start), True  # skip the tag
        elif self._released == 0 and not self._started[False] and stripped:
            if self.start.startswith(stripped) and len(stripped) < len(self.start) and not final:
                return "", ""  # the model may repeat the opening tag the template wrote
            if stripped.startswith(self.start):
                self._released = len(text) - len(stripped) + len(self.start)
        cut = text.find(self.end, self._released)
        if cut >= 0:
            reasoning = self._take(cut, answer=False)
            self._released, self._in_answer = cut + len(self.end), True
            return reasoning.rstrip(), self._take(len(text), answer=True)
        end = len(text) if final else len(text) - _partial_suffix(text, self.end)
        return self._take(max(end, self._released), answer=False), ""

    def _take(self, end: int, answer: bool) -> str:
        out, self._released = self._text[self._released : end], end
        if not self._started[answer]:
            out = out.lstrip()
            self._started[answer] = bool(out)
        return out


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1's template opens `<think>` in the prompt: the output is reasoning until `</think>`."""

    name = "deepseek_r1"
    opened_by_template = True

    def extract(self, text: str) -> tuple[str, str]:
        if self.end not in text:
            stripped = text.lstrip()
            return (stripped[len(self.start) :] if stripped.startswith(self.start) else stripped).strip(), ""
        return super().extract(text)


def make_reasoning_parser(name: str) -> ReasoningParser:
    """A fresh parser (one per generated sequence) of the registered format `name`."""
    if name not in REASONING_PARSERS:
        raise InvalidRequestError(
            f"unknown reasoning parser {name!r}; registered: {', '.join(REASONING_PARSERS.names())}"
        )
    return REASONING_PARSERS.get(name)()  # type: ignore[no-any-return]
