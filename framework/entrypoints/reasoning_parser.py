"""Reasoning parsers: a reasoning model's output -> (reasoning, answer), whole or as a stream of deltas.

The built-in `ThinkReasoningParser` (registered as `think`, `qwen3` and `deepseek_r1`) reads the
`<think>...</think>` section Qwen3 and DeepSeek-R1 write. Where the output starts depends on the prompt, so a parser
is made for one request (`make_reasoning_parser(name, prompt_text, budgeted)`):

- the output starts inside the thinking when the template opened it (the prompt ends with `<think>`, as
  DeepSeek-R1's and Qwen3's thinking templates write; `deepseek_r1` assumes it always) or when the request has a
  thinking budget (the engine then treats everything before the first `</think>` as thinking and forces one): the
  output is reasoning up to `</think>` (a `<think>` the model writes at its start is dropped), all reasoning when
  `</think>` never came (the tokens ran out while thinking);
- otherwise an output that starts with `<think>` is reasoning up to `</think>` (or to its end), and any other
  output is all answer (thinking was off; a stray `</think>` in it stays in the answer).

The reasoning is stripped of surrounding whitespace and the answer after `</think>` of its leading whitespace. A
stream (`extract_delta`) gives out exactly the non-streamed parse of the whole output, however the output is split
into deltas: it holds back only what the rest of the output may still change (a partial tag, the reasoning's
trailing whitespace, leading text that may still become `<think>`). A third party registers another parser in the
`mrv2.reasoning_parsers` entry-point group; its class takes the prompt text and the `budgeted` flag.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

from framework.config.registry import REASONING_PARSERS
from framework.params.request_errors import InvalidRequestError


class ReasoningParser(ABC):
    """One reasoning format; one instance per generated sequence (streaming keeps state here). `prompt_text` is
    the rendered prompt the sequence continues ("" when unknown); `budgeted`: the request has a thinking budget."""

    name: ClassVar[str] = ""

    def __init__(self, prompt_text: str = "", budgeted: bool = False) -> None:
        self.prompt_text, self.budgeted = prompt_text, budgeted

    @abstractmethod
    def extract(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a finished output."""

    @abstractmethod
    def extract_delta(self, delta: str, final: bool) -> tuple[str, str]:
        """(reasoning delta, answer delta) after the output grew by `delta`; `final` at its end. Joined over a
        whole output the deltas equal `extract` of it."""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker` (a tag that may still complete)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ThinkReasoningParser(ReasoningParser):
    """`<think>reasoning</think>answer` (see the module docstring for where the output starts)."""

    name = "think"
    start, end = "<think>", "</think>"
    opened_by_template: ClassVar[bool] = False  # True: every output starts inside the thinking section

    def __init__(self, prompt_text: str = "", budgeted: bool = False) -> None:
        super().__init__(prompt_text, budgeted)
        self.opened = self.opened_by_template or budgeted or prompt_text.rstrip().endswith(self.start)
        self._text = ""
        self._mode: Optional[str] = None  # None (undecided), "reasoning" or "answer"
        self._pos = 0  # characters of `_text` given out or dropped
        self._strip_answer = True  # the answer after `</think>` loses its leading whitespace
        self._started = {"reasoning": False, "answer": False}

    def _body_start(self, text: str) -> Optional[int]:
        """Where the reasoning starts in `text` (None: all answer), the opening tag skipped."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            return len(text) - len(stripped) + len(self.start)
        return 0 if self.opened else None

    def extract(self, text: str) -> tuple[str, str]:
        begin = self._body_start(text)
        if begin is None:
            return "", text
        cut = text.find(self.end, begin)
        if cut < 0:
            return text[begin:].strip(), ""
        return text[begin:cut].strip(), text[cut + len(self.end) :].lstrip()

    def extract_delta(self, delta: str, final: bool) -> tuple[str, str]:
        self._text += delta
        if self._mode is None and not self._decide(final):
            return "", ""
        reasoning = self._reasoning(final) if self._mode == "reasoning" else ""
        answer = self._take_answer() if self._mode == "answer" else ""
        return reasoning, answer

    def _decide(self, final: bool) -> bool:
        """Pick the mode once the start of the output is certain; False while it may still become `<think>`."""
        stripped = self._text.lstrip()
        if not final and (not stripped or (self.start.startswith(stripped) and stripped != self.start)):
            return False
        begin = self._body_start(self._text)
        if begin is None:
            self._mode, self._strip_answer = "answer", False
        else:
            self._mode, self._pos = "reasoning", begin
        return True

    def _reasoning(self, final: bool) -> str:
        """The reasoning that is certain now; switches to the answer at `</think>`."""
        text = self._text
        cut = text.find(self.end, self._pos)
        if cut >= 0:
            out = self._release(cut, trailing=False)
            self._mode, self._pos = "answer", cut + len(self.end)
            return out
        safe = len(text) if final else len(text) - _partial_suffix(text[self._pos :], self.end)
        return self._release(safe, trailing=False) if final else self._release(safe, trailing=True)

    def _release(self, end: int, trailing: bool) -> str:
        """Reasoning up to `end`, its leading whitespace dropped; trailing whitespace held back when `trailing` (more
        reasoning may follow it) and dropped otherwise (the reasoning ended)."""
        chunk = self._text[self._pos : end]
        if not self._started["reasoning"]:
            lead = len(chunk) - len(chunk.lstrip())
            self._pos, chunk = self._pos + lead, chunk[lead:]
        body = chunk.rstrip()
        self._pos += len(body) if trailing else len(chunk)
        self._started["reasoning"] = self._started["reasoning"] or bool(body)
        return body

    def _take_answer(self) -> str:
        chunk, self._pos = self._text[self._pos :], len(self._text)
        if self._strip_answer and not self._started["answer"]:
            chunk = chunk.lstrip()
            self._started["answer"] = bool(chunk)
        return chunk


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1's template opens `<think>` in the prompt: the output is reasoning until `</think>`."""

    name = "deepseek_r1"
    opened_by_template = True


def make_reasoning_parser(name: str, prompt_text: str = "", budgeted: bool = False) -> ReasoningParser:
    """A fresh parser (one per generated sequence) of the registered format `name`, for a sequence that continues
    `prompt_text` (the rendered prompt: it tells whether the template opened the thinking) under a thinking budget
    or not (`budgeted`)."""
    if name not in REASONING_PARSERS:
        raise InvalidRequestError(
            f"unknown reasoning parser {name!r}; registered: {', '.join(REASONING_PARSERS.names())}"
        )
    return REASONING_PARSERS.get(name)(prompt_text, budgeted)  # type: ignore[no-any-return]
