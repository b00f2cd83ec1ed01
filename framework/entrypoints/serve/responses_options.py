"""The Responses API's `reasoning.effort`, `top_logprobs` and `include`, checked (400 naming the field) and turned
into what the chat machinery reads: a thinking budget, and the logprobs of the answer's tokens.

`reasoning.effort` -> `thinking_token_budget` (EFFORT_BUDGETS; a request's own `thinking_token_budget` wins):
`none` ends the thinking at once, `minimal` 64 tokens, `low` 512, `medium` 2048, `high` 8192, `xhigh` and `max`
no budget (the model thinks as long as `max_output_tokens` lets it).

Logprobs come with `include: ["message.output_text.logprobs"]` (as OpenAI; `top_logprobs` alone asks for none),
`top_logprobs` (0-20) alternatives per token. They cover the answer's tokens: those after the end-of-thinking
sequence, and with tool calls only those whose text the message carries.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from framework.entrypoints.chat_output import THINK_END
from framework.entrypoints.serve.errors import ApiError
from framework.entrypoints.serve.protocol import TokenLogprobs
from framework.entrypoints.serve.responses import TokenText, chat_logprobs

EFFORT_BUDGETS: dict[str, Optional[int]] = {
    "none": 0,
    "minimal": 64,
    "low": 512,
    "medium": 2048,
    "high": 8192,
    "xhigh": None,
    "max": None,
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What OpenAI's `include` may name; this server has none of the other items (no hosted tools, no stored state).
OPENAI_INCLUDABLE = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
)
MAX_TOP_LOGPROBS = 20


def effort_budget(reasoning: Optional[Mapping[str, Any]], explicit: Optional[int]) -> Optional[int]:
    """The thinking budget of `reasoning.effort` (None: no budget); `explicit` (the request's own) wins."""
    if reasoning is None:
        return explicit
    if not isinstance(reasoning, Mapping):
        raise ApiError.invalid("reasoning must be an object such as {'effort': 'low'}", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORT_BUDGETS:
        raise ApiError.invalid(
            f"reasoning.effort={effort!r} is not one of {', '.join(EFFORT_BUDGETS)}", "reasoning.effort"
        )
    if explicit is not None or effort is None:
        return explicit
    return EFFORT_BUDGETS[effort]


HARMONY_EFFORTS = ("low", "medium", "high")


def harmony_effort(reasoning: Optional[Mapping[str, Any]]) -> Optional[str]:
    """gpt-oss's reasoning level of `reasoning.effort` in the harmony format (None: its default); 400 for a level
    gpt-oss does not have."""
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    if effort is not None and effort not in HARMONY_EFFORTS:
        raise ApiError.invalid(
            f"reasoning.effort={effort!r} is not one of gpt-oss's reasoning levels ({', '.join(HARMONY_EFFORTS)})",
            "reasoning.effort",
        )
    return effort


def logprobs_k(include: Optional[Sequence[Any]], top_logprobs: Optional[int], limit: int) -> Optional[int]:
    """Alternatives per token when the answer's logprobs are asked for (`include`), else None; 400 for an
    unknown or unsupported `include` entry and a `top_logprobs` outside 0-20 or above `sampler.max_logprobs`."""
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError.invalid(f"top_logprobs={top_logprobs} must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    if top_logprobs is not None and top_logprobs > limit:
        raise ApiError.invalid(f"top_logprobs={top_logprobs} exceeds sampler.max_logprobs={limit}", "top_logprobs")
    for entry in include or []:
        if entry == LOGPROBS_INCLUDE:
            continue
        why = "is not supported by this server" if entry in OPENAI_INCLUDABLE else "is not a known value"
        raise ApiError.invalid(f"include entry {entry!r} {why} (supported: {LOGPROBS_INCLUDE!r})", "include")
    return (top_logprobs or 0) if LOGPROBS_INCLUDE in (include or []) else None


def token_text(tokenizer: Any) -> TokenText:
    """A token's text as logprobs show it (special tokens spelt out)."""
    return (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer is not None else str


def answer_start(tokens: Sequence[int], end_ids: Sequence[int]) -> int:
    """Index of the first answer token: after the first end-of-thinking sequence, 0 when there is none."""
    m = len(end_ids)
    for i in range(len(tokens) - m + 1) if m else ():
        if list(tokens[i : i + m]) == list(end_ids):
            return i + m
    return 0


class AnswerLogprobs:
    """The answer's token logprobs of one output, whole or as a stream gains tokens (`k` alternatives each)."""

    def __init__(self, k: int, token_text: TokenText, tokenizer: Any, reasoning: bool) -> None:
        self.k, self.token_text = k, token_text
        self.end_ids = tokenizer.encode(THINK_END) if reasoning and tokenizer is not None else []
        self.eos = getattr(tokenizer, "eos_token_id", None)  # ends the output; no part of its text
        self.tokens: list[int] = []
        self.entries: list[TokenLogprobs] = []
        self.sent = 0  # tokens whose logprobs a delta carried

    def add(self, tokens: Sequence[int], entries: Optional[Sequence[TokenLogprobs]]) -> None:
        self.tokens += tokens
        self.entries += entries or []

    def items(self, start: int, stop: int) -> list[dict[str, Any]]:
        kept = [i for i in range(start, min(stop, len(self.entries))) if self.tokens[i] != self.eos]
        tokens, entries = [self.tokens[i] for i in kept], [self.entries[i] for i in kept]
        out: list[dict[str, Any]] = chat_logprobs(tokens, entries, self.k, self.token_text)["content"]
        return out

    def delta(self) -> list[dict[str, Any]]:
        """The logprobs of the answer tokens that arrived since the last content delta (streaming)."""
        start = max(self.sent, answer_start(self.tokens, self.end_ids))
        self.sent = max(self.sent, len(self.tokens))
        return self.items(start, len(self.tokens))

    def whole(self, content: Optional[str], has_calls: bool) -> list[dict[str, Any]]:
        """The logprobs of a finished answer: with tool calls, the tokens up to the message's text only."""
        start = answer_start(self.tokens, self.end_ids)
        stop = len(self.tokens)
        if has_calls:
            covered, stop = "", start
            while stop < len(self.tokens) and len(covered.strip()) < len((content or "").strip()):
                covered += self.token_text(self.tokens[stop])
                stop += 1
        return self.items(start, stop)
