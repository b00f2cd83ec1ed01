"""A generation's events as an HTTP answer: one JSON body, or a stream of server-sent events (one per event).

A streamed request waits for its first event before answering, so a request the engine refuses still gets its
HTTP 400; every later batch of events is one write.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Union

from fastapi import Request
from fastapi.responses import StreamingResponse

from framework.entrypoints.serve.errors import ApiError
from framework.entrypoints.serve.generation import Generation, SequenceEvent
from framework.entrypoints.serve.stream_frames import DONE_FRAME, sse_frame


async def collect(gen: Generation, request: Request) -> list[list[SequenceEvent]]:
    """Every event of every choice (non-streaming), aborting if the client goes away meanwhile."""
    per_choice: list[list[SequenceEvent]] = [[] for _ in range(len(gen.prompts) * gen.params.n)]
    async for batch in gen.events(request.is_disconnected):
        for event in batch:
            per_choice[event.choice].append(event)
    return per_choice


async def stream_frames(
    first: list[SequenceEvent],
    events: AsyncIterator[list[SequenceEvent]],
    frame: Callable[[SequenceEvent], Union[bytes, dict[str, Any]]],
    tail: Any,
) -> AsyncIterator[bytes]:
    """SSE frames: one per event (one write per batch; `frame` gives its bytes, or a chunk dict to encode), then
    the tail (usage), then [DONE]; an engine failure mid-stream becomes a final error event. Leaving early (the
    client went away) closes `events`, which aborts the request."""

    def frames(batch: list[SequenceEvent]) -> bytes:
        out = [frame(e) for e in batch]
        return b"".join(f if isinstance(f, bytes) else sse_frame(f) for f in out)

    try:
        yield frames(first)
        async for batch in events:
            yield frames(batch)
        for body in tail():
            yield sse_frame(body)
    except ApiError as err:
        yield sse_frame(err.body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield DONE_FRAME


async def respond(
    gen: Generation,
    request: Request,
    stream: bool,
    frame: Callable[[SequenceEvent], Union[bytes, dict[str, Any]]],
    tail: Any,
    body: Any,
) -> Union[StreamingResponse, dict[str, Any]]:
    """The whole body (`body(per-choice events)`) or, for a stream, the SSE response (`frame` per event, then
    `tail()`'s frames)."""
    if not stream:
        return body(await collect(gen, request))
    events = gen.events(request.is_disconnected, watch_until_first=True)  # a client may leave before its first token
    try:
        first = await events.__anext__()
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(stream_frames(first, events, frame, tail), media_type="text/event-stream")
