"""A gpt-oss turn's tokens -> `reasoning_content`, `content` and `tool_calls`, read by channel with openai-harmony's
`StreamableParser`, whole or as a stream.

The output continues the prompt's `<|start|>assistant`: messages of the form `<|channel|>C[ to=R][ <|constrain|>T]
<|message|>text` ended by `<|end|>` (the turn goes on with `<|start|>assistant...`), `<|return|>` (the answer is
done) or `<|call|>` (a tool call waits for its result). Each message's text goes by its header:

- channel `analysis` -> reasoning; `final`, and `commentary` without a recipient (a preamble) -> content;
- recipient `functions.NAME` (whatever the channel, when the request offered tools) -> a tool call named NAME
  whose arguments are the message's text as the model wrote it; announced when its header ends, its arguments
  streamed as written.

Malformed output is plain content, never an error: from the first token that does not fit the format (text where
a message must start, a header longer than MAX_HEADER_TOKENS, a message from another role than the assistant's,
without a channel, or to another recipient), the rest of the output is content, its special tokens left out. What
came before it stands, and a header that was still being read is part of that content. A header the output
ended in after a whole message (the tokens ran out) is dropped. So a streamed output's deltas join to exactly the
non-streamed parts, since both run this one token loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from framework.entrypoints.chat_output import ChatDelta, ChatOutputParser, ChatParts
from framework.entrypoints.tool_calls import ToolSetup
from framework.entrypoints.tool_parsers import ToolCall, new_call_id

MAX_HEADER_TOKENS = 64  # a header is a role, a channel, a recipient and a content type: a few tokens
CALL_PREFIX = "functions."
EXPECT_START, HEADER, CONTENT = "expect_start", "header", "content"  # where the parser is


@dataclass
class _Call:
    name: str
    id: str = field(default_factory=new_call_id)
    arguments: str = ""


class HarmonyStream:
    """One output's token loop (see the module docstring); `step` each token, then `finish` at the end.

    The parser's state is followed here from the format's own tokens (`<|start|>` opens a header, `<|message|>`
    ends it, `<|end|>` / `<|return|>` / `<|call|>` end the content, as openai-harmony's parser moves): its
    `state` property serializes every content token so far, which would make each step cost the whole output."""

    def __init__(self, encoding: Any, tools_active: bool) -> None:
        from openai_harmony import Role, StreamableParser

        self._encoding = encoding
        self._tools_active = tools_active
        self._parser = StreamableParser(encoding, Role.ASSISTANT)
        self._message_token = encoding.encode("<|message|>", allowed_special="all")[0]
        self._end_tokens = set(encoding.stop_tokens())
        self._state = HEADER  # the prompt's `<|start|>assistant` opened the first header
        self._tokens: list[int] = []
        self._header_start = 0  # where the message being read began (its header's first token)
        self._kind: Optional[str] = None  # what the message being read is: "reasoning", "content" or "call"
        self._messages = 0  # whole messages read
        self._fallback: Optional[int] = None  # from this token on the output is plain content
        self._fallback_sent = 0  # tokens of the plain content whose text was given out
        self.calls: list[_Call] = []
        self.reasoning_tokens = 0  # tokens of analysis messages, headers and end tokens included

    def step(self, token: int, out: ChatDelta) -> None:
        index = len(self._tokens)
        self._tokens.append(token)
        if self._fallback is not None:
            return
        from openai_harmony import HarmonyError

        try:
            self._parser.process(token)
        except HarmonyError:  # text where a message must start, or a header that does not parse
            self._fail(self._header_start if self._state == HEADER else index)
            return
        if self._state == EXPECT_START:  # the parser took it, so it was <|start|>
            self._state, self._header_start = HEADER, index
        elif self._state == HEADER and token == self._message_token:
            self._state = CONTENT
            self._begin_message(out)
        elif self._state == HEADER and index + 1 - self._header_start > MAX_HEADER_TOKENS:
            self._fail(self._header_start)
        elif self._state == CONTENT and token in self._end_tokens:
            self._state = EXPECT_START
            self._end_message(index + 1)
        elif self._state == CONTENT:
            self._route(self._parser.last_content_delta or "", out)

    def finish(self, out: ChatDelta) -> None:
        """The output ended: a message cut off counts as far as it went; a header it ended in is content when it
        is the turn's first, and dropped after a whole message."""
        if self._fallback is None:
            if self._state == CONTENT:
                self._end_message(len(self._tokens))
            elif self._state == HEADER and self._messages == 0:
                self._fail(self._header_start)
        self.plain_content(out, final=True)

    def _begin_message(self, out: ChatDelta) -> None:
        from openai_harmony import Role

        parser = self._parser
        channel, recipient = parser.current_channel, parser.current_recipient
        if parser.current_role is not Role.ASSISTANT or channel is None:
            self._kind = None
        elif recipient is None:
            self._kind = "reasoning" if channel == "analysis" else "content"
        elif recipient.startswith(CALL_PREFIX) and len(recipient) > len(CALL_PREFIX) and self._tools_active:
            self._kind = "call"
        else:
            self._kind = None
        if self._kind is None:
            self._fail(self._header_start)
        elif self._kind == "call":
            call = _Call(recipient[len(CALL_PREFIX) :])  # type: ignore[index]
            self.calls.append(call)
            out.tool_calls.append(
                {
                    "index": len(self.calls) - 1,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            )

    def _route(self, text: str, out: ChatDelta) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            out.reasoning += text
        elif self._kind == "content":
            out.content += text
        elif self._kind == "call":
            self.calls[-1].arguments += text
            out.tool_calls.append({"index": len(self.calls) - 1, "function": {"arguments": text}})

    def _end_message(self, end: int) -> None:
        if self._kind == "reasoning":
            self.reasoning_tokens += end - self._header_start
        self._messages += 1
        self._header_start, self._kind = end, None

    def _fail(self, start: int) -> None:
        """The output stops fitting the format at token `start`: from there it is plain content."""
        self._fallback, self._kind = start, None

    def plain_content(self, out: ChatDelta, final: bool) -> None:
        """Give out the plain content of the tokens not given out yet (a character still incomplete waits for its
        next tokens, unless `final`)."""
        if self._fallback is None:
            return
        start = max(self._fallback, self._fallback_sent)
        pending = [t for t in self._tokens[start:] if not self._encoding.is_special_token(t)]
        text = self._encoding.decode(pending)
        if not final and text.endswith("\ufffd"):  # an incomplete UTF-8 character decodes to U+FFFD for now
            return
        out.content += text
        self._fallback_sent = len(self._tokens)


class HarmonyOutputParser(ChatOutputParser):
    """The harmony output parser of one generated sequence; `parse` and `feed` read tokens, not text."""

    def __init__(self, encoding: Any, tools: Optional[ToolSetup] = None) -> None:
        super().__init__(tools)
        self._encoding = encoding
        self._stream = HarmonyStream(encoding, self.tools.active)

    @property
    def has_reasoning(self) -> bool:
        return True

    @property
    def streamed_calls(self) -> list[ToolCall]:
        return [ToolCall(c.name, c.arguments, c.id) for c in self._stream.calls]

    def _run(self, token_ids: Sequence[int]) -> tuple[HarmonyStream, ChatDelta]:
        stream, out = HarmonyStream(self._encoding, self.tools.active), ChatDelta()
        for token in token_ids:
            stream.step(token, out)
        stream.finish(out)
        return stream, out

    def parse(self, text: str, token_ids: Sequence[int] = ()) -> ChatParts:
        stream, out = self._run(token_ids)
        calls = [ToolCall(c.name, c.arguments, c.id) for c in stream.calls]
        content: Optional[str] = out.content
        if calls and not out.content.strip():
            content = None  # as OpenAI: a turn of only calls has no content
        return ChatParts(content, calls, out.reasoning or None)

    def feed(self, delta: str, final: bool, token_ids: Sequence[int] = ()) -> ChatDelta:
        out = ChatDelta()
        for token in token_ids:
            self._stream.step(token, out)
        if final:
            self._stream.finish(out)
        else:
            self._stream.plain_content(out, final=False)
        return out

    def reasoning_tokens(self, token_ids: Sequence[int], text: str, end_ids: Sequence[int]) -> int:
        return self._run(token_ids)[0].reasoning_tokens
