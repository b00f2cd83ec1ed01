"""Response bodies in OpenAI's shapes: completion and chat choices, their logprobs, usage, SSE framing."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional, Sequence

from framework.entrypoints.serve.protocol import TokenLogprobs

TokenText = Callable[[int], str]
MIN_LOGPROB = -9999.0  # vLLM's floor: a token a grammar masks has -inf, which is not JSON


def finite(logprob: float) -> float:
    """A logprob JSON can carry (JSON has no -Infinity), as vLLM sends it."""
    return max(logprob, MIN_LOGPROB)


def sse(data: Any) -> str:
    """One server-sent event (`data: ...` and a blank line); a dict is sent as JSON."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: Optional[int] = None
) -> dict[str, Any]:
    """OpenAI's usage object; `reasoning_tokens` (chat with a reasoning parser) adds `completion_tokens_details`."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def envelope(kind: str, request_id: str, model: str, created: Optional[int] = None) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of an entry (the sampled token counts when it is among them)."""
    ranked = {token: (rank, lp) for token, lp, rank in entry[1:]}
    token, lp, rank = entry[0]
    if 1 <= rank <= k:
        ranked[token] = (rank, lp)
    return [(t, lp) for t, (rank, lp) in sorted(ranked.items(), key=lambda x: x[1][0])][:k]


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Optional[TokenLogprobs]],
    k: int,
    token_text: TokenText,
    text_offset: int = 0,
) -> dict[str, Any]:
    """The legacy completions format: parallel lists of tokens, their logprobs, top-k dicts and text offsets."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for token, entry in zip(token_ids, entries):
        text = token_text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(finite(entry[0][1]) if entry is not None else None)
        top = None
        if entry is not None:  # OpenAI's legacy format: the k most likely, and always the sampled token (<= k + 1)
            top = {token_text(t): finite(lp) for t, lp in _top(entry, k)}
            top.setdefault(text, finite(entry[0][1]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_token(token: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprobs], k: int, token_text: TokenText
) -> dict[str, Any]:
    """The chat format: per token, its text, logprob, bytes and its `top_logprobs` (k most likely)."""
    content = []
    for token, entry in zip(token_ids, entries):
        item = _chat_token(token, entry[0][1], token_text)
        item["top_logprobs"] = [_chat_token(t, lp, token_text) for t, lp in _top(entry, k)]
        content.append(item)
    return {"content": content, "refusal": None}
