"""A bare streaming HTTP/1.1 client for the serving benchmarks: what a user of one stream sees, and when.

Per request it records the arrival time of every server-sent event that carries a choice, the text of each, and
how many HTTP chunks (server writes) carried them; the usage frame gives the completion tokens. It only splits
bytes per chunk (no JSON parsing of events), so the measuring client is not what limits a fast server.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Optional

_COMPLETION_TOKENS = re.compile(rb'"usage": ?\{[^}]*"completion_tokens": ?(\d+)')
_TEXT = re.compile(rb'"text": ?"((?:[^"\\]|\\.)*)"')


@dataclass
class StreamRecord:
    """One streamed completion as its client saw it."""

    start: float  # when the request was sent (perf_counter seconds)
    event_times: list[float] = field(default_factory=list)  # arrival of each event with a choice
    event_texts: list[str] = field(default_factory=list)  # its `text` (kept only when asked for)
    num_http_chunks: int = 0  # server writes that carried those events
    completion_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.event_times[0] - self.start if self.event_times else math.nan

    @property
    def gaps_s(self) -> list[float]:
        """The time between consecutive events of this stream (what a reader sees as a pause)."""
        return [b - a for a, b in zip(self.event_times, self.event_times[1:])]

    @property
    def tpot_s(self) -> float:
        if self.completion_tokens < 2 or len(self.event_times) < 2:
            return math.nan
        return (self.event_times[-1] - self.event_times[0]) / (self.completion_tokens - 1)


def completion_body(prompt: list[int], max_tokens: int, temperature: float, seed: int) -> bytes:
    """A streamed token-id completion with usage, `ignore_eos` (the benchmarks' request)."""
    return json.dumps(
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def stream_completion(
    host: str, port: int, body: bytes, delay: float = 0.0, keep_text: bool = False, timeout_s: Optional[float] = None
) -> StreamRecord:
    """POST /v1/completions after `delay` s over a connection of its own and read the stream to its end."""
    await asyncio.sleep(delay)
    record = StreamRecord(time.perf_counter())
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(body)) + body
        )
        await asyncio.wait_for(_read_stream(reader, record, keep_text), timeout_s)
    finally:
        writer.close()
    return record


async def _read_stream(reader: asyncio.StreamReader, record: StreamRecord, keep_text: bool) -> None:
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status!r}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers (the body is chunked)
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        now = time.perf_counter()
        carried = False
        for event in data.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue  # [DONE], the chunk's trailing CRLF
            usage = _COMPLETION_TOKENS.search(event)
            if usage is not None:  # the usage frame: no choices
                record.completion_tokens = int(usage.group(1))
                continue
            carried = True
            record.event_times.append(now)
            if keep_text:
                text = _TEXT.search(event)
                record.event_texts.append(json.loads(b'"' + text.group(1) + b'"') if text else "")
        record.num_http_chunks += carried
