"""Server-sent event frames as bytes: msgspec JSON, and pre-encoded frames for the common streamed chunk.

Under full load a server writes one frame per stream per engine step, so building a dict and encoding it for
every token is a visible share of the API server's time. A streamed completion's chunks differ only in the
choice index and the text while the sequence runs without logprobs: `CompletionFrames` encodes the envelope once
(id, object, created, model) and then writes only the index and the JSON string of the text.
"""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
DONE_FRAME = b"data: [DONE]\n\n"


def json_bytes(data: Any) -> bytes:
    """Compact UTF-8 JSON (what `json.dumps(..., ensure_ascii=False)` means, without the spaces)."""
    return _encode(data)


def sse_frame(data: Any) -> bytes:
    """One server-sent event (`data: ...` and a blank line); a str is sent as it is, anything else as JSON."""
    if isinstance(data, str):
        return b"data: " + data.encode() + b"\n\n"
    return b"data: " + _encode(data) + b"\n\n"


class CompletionFrames:
    """The frames of one streamed /v1/completions response whose envelope is `head`."""

    def __init__(self, head: dict[str, Any]) -> None:
        envelope = _encode(head)  # b'{"id":...,"model":...}'
        self._prefix = b"data: " + envelope[:-1] + b',"choices":[{"index":'

    def running_text(self, choice: int, text: str) -> bytes:
        """The chunk of a running choice without logprobs: equal to `sse_frame` of the full chunk dict."""
        return b'%s%d,"text":%s,"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n' % (
            self._prefix,
            choice,
            _encode(text),
        )
