"""An assistant turn's text -> the parts an OpenAI chat message has: `reasoning_content`, `content` and
`tool_calls`, for a finished output (`parse`) or as it streams (`feed`). Reasoning is split off first; tool calls
are parsed from the answer only (a call the model only thought about is no call)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from framework.engine.request import RequestOutput
from framework.entrypoints.reasoning_parser import ReasoningParser, make_reasoning_parser
from framework.entrypoints.tool_calls import ToolSetup
from framework.entrypoints.tool_parsers import ToolCall, ToolParser
from framework.params.sampling_params import THINK_END, SamplingParams


@dataclass
class ChatParts:
    """One assistant turn, parsed; `reasoning` is None when no reasoning parser is configured."""

    content: Optional[str]
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: Optional[str] = None


@dataclass
class ChatDelta:
    """What a stream gained: reasoning text, answer text, OpenAI `tool_calls` deltas."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ChatOutputParser:
    """The parsers of one generated sequence (make one per choice: streaming keeps state)."""

    def __init__(
        self,
        tools: Optional[ToolSetup] = None,
        reasoning_parser: Optional[str] = None,
        prompt_text: str = "",
        budgeted: bool = False,
    ) -> None:
        """`prompt_text` (the rendered prompt: did its template open the thinking?) and `budgeted` (a thinking
        budget applies) decide where the output starts (`framework.entrypoints.reasoning_parser`)."""
        self.tools = tools or ToolSetup()
        self._tool: Optional[ToolParser] = self.tools.new_parser()
        self._reasoning: Optional[ReasoningParser] = (
            make_reasoning_parser(reasoning_parser, prompt_text, budgeted) if reasoning_parser else None
        )

    @property
    def has_reasoning(self) -> bool:
        return self._reasoning is not None

    @property
    def streamed_calls(self) -> list[ToolCall]:
        return self._tool.calls if self._tool is not None else []

    def parse(self, text: str, token_ids: Sequence[int] = ()) -> ChatParts:
        """The parts of a finished output (`text`; a format read by tokens reads `token_ids`)."""
        reasoning: Optional[str] = None
        answer = text
        if self._reasoning is not None:
            reasoning, answer = self._reasoning.extract(text)
        calls: list[ToolCall] = []
        if self._tool is not None:
            answer, calls = self._tool.extract(answer)
        content: Optional[str] = answer
        if calls and not answer.strip():
            content = None  # as OpenAI: a turn of only calls has no content
        return ChatParts(content, calls, reasoning)

    def feed(self, delta: str, final: bool, token_ids: Sequence[int] = ()) -> ChatDelta:
        """The parts a stream may show after the output grew by `delta` (its tokens: `token_ids`; `final`: it
        ended)."""
        reasoning, answer = "", delta
        if self._reasoning is not None:
            reasoning, answer = self._reasoning.extract_delta(delta, final)
        if self._tool is None:
            return ChatDelta(reasoning, answer)
        content, calls = self._tool.extract_delta(answer, final)
        return ChatDelta(reasoning, content, calls)

    def reasoning_tokens(self, token_ids: Sequence[int], text: str, end_ids: Sequence[int]) -> int:
        """Output tokens of the thinking section of a finished output (`end_ids` spell the end of thinking)."""
        return reasoning_token_count(token_ids, end_ids, self.parse(text, token_ids).reasoning)

    def finish_reason(self, reason: Optional[str], has_calls: bool) -> Optional[str]:
        """A turn that ended on its own with calls finishes with "tool_calls" ("function_call" for `functions`)."""
        if reason == "stop" and has_calls:
            return "function_call" if self.tools.legacy else "tool_calls"
        return reason

    def message(self, parts: ChatParts) -> dict[str, Any]:
        """The OpenAI `message` of a non-streaming choice."""
        out: dict[str, Any] = {"role": "assistant", "content": parts.content}
        if parts.tool_calls and self.tools.legacy:
            out["function_call"] = {"name": parts.tool_calls[0].name, "arguments": parts.tool_calls[0].arguments}
        elif parts.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in parts.tool_calls]
        if self.has_reasoning:
            out["reasoning_content"] = parts.reasoning
        return out

    def delta(self, part: ChatDelta) -> dict[str, Any]:
        """The OpenAI `delta` of a streamed chunk (the first chunk's `role` is the caller's)."""
        out: dict[str, Any] = {"content": part.content}
        if part.reasoning:
            out["reasoning_content"] = part.reasoning
        if part.tool_calls and self.tools.legacy:  # the first call, as `function_call` fragments
            call: dict[str, str] = {}
            for d in (d for d in part.tool_calls if d["index"] == 0):
                call.update({k: call.get(k, "") + v for k, v in d["function"].items()})
            out["function_call"] = call
        elif part.tool_calls:
            out["tool_calls"] = part.tool_calls
        return out


THINK_START = "<think>"


def thinking_budget_for(prompt_text: str, budget: Optional[int]) -> Optional[int]:
    """The `thinking_token_budget` a chat prompt takes: None when the template already closed the thinking (its
    last `</think>` comes after its last `<think>`, as Qwen3's do with `enable_thinking=false`), so a budget never
    forces `</think>` into an answer."""
    if budget is None:
        return None
    closed = prompt_text.rfind(THINK_END) > prompt_text.rfind(THINK_START)
    return None if closed else budget


def reasoning_token_count(token_ids: Sequence[int], end_ids: Sequence[int], reasoning: Optional[str]) -> int:
    """Output tokens of the thinking section: up to and including the first end-of-thinking sequence; all of them
    when the output never ended its thinking but holds reasoning (the tokens ran out while thinking); else 0."""
    m = len(end_ids)
    if m:
        for i in range(len(token_ids) - m + 1):
            if list(token_ids[i : i + m]) == list(end_ids):
                return i + m
    return len(token_ids) if reasoning else 0


def parse_chat_outputs(
    outputs: list[RequestOutput],
    tools: ToolSetup,
    reasoning_parser: Optional[str],
    encode: Optional[Callable[[str], list[int]]] = None,
    prompt_texts: Optional[Sequence[str]] = None,
    params: Optional[Sequence[SamplingParams]] = None,
    make_parser: Optional[Callable[[], ChatOutputParser]] = None,
) -> list[RequestOutput]:
    """`LLM.chat`'s outputs with each sequence's text split into content, `tool_calls` and `reasoning_content`
    (the finish reason "tool_calls" where a turn that ended on its own made calls), and `reasoning_tokens`
    counted (`encode` spells the end of thinking; per output, `prompt_texts` is its rendered prompt and `params`
    its sampling parameters, whose thinking budget says that the output starts thinking). `make_parser`: a chat
    format's own parser (harmony's), instead of the text parsers `tools` and `reasoning_parser` name."""
    if make_parser is None and not tools.active and reasoning_parser is None:
        return outputs
    end_ids = encode(THINK_END) if encode is not None and make_parser is None else []
    for i, out in enumerate(outputs):
        sequences = []
        for seq in out.outputs:
            if make_parser is not None:
                parser = make_parser()
            else:
                prompt = prompt_texts[i] if prompt_texts else ""
                budget = params is not None and params[i].thinking_token_budget is not None
                parser = ChatOutputParser(tools, reasoning_parser, prompt, budget)
            parts = parser.parse(seq.text, seq.token_ids)
            seq = dataclasses.replace(
                seq,
                text=parts.content or "",
                tool_calls=[c.to_openai() for c in parts.tool_calls] if tools.active else None,
                reasoning_content=parts.reasoning,
                reasoning_tokens=(
                    parser.reasoning_tokens(seq.token_ids, seq.text, end_ids) if parser.has_reasoning else None
                ),
                finish_reason=parser.finish_reason(seq.finish_reason, bool(parts.tool_calls)),
            )
            sequences.append(seq)
        out.sequences = sequences
        out.text, out.finish_reason = sequences[0].text, sequences[0].finish_reason
    return outputs
