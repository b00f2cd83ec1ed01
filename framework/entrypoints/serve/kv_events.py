"""Publishing KV-cache events over ZMQ (`serve.kv_events`), as vLLM's engines do, so KV-aware routers subscribe
to mrv2 unchanged.

- PUB socket (`endpoint`): one message per engine step that changed the prefix cache, three frames: the topic,
  the batch's sequence number (8 bytes, big-endian, from 0) and the msgpack `KVEventBatch`. The first batch
  after start-up is `AllBlocksCleared`, so a subscriber drops what it knew of an earlier run of this endpoint.
- ROUTER socket (`replay_endpoint`): a client (a REQ or DEALER socket) sends a start sequence number (8 bytes,
  big-endian) and gets, one message each, (sequence number, batch) for every batch still buffered from that
  number on, then an end marker: sequence number -1 and an empty payload.

Data-parallel rank r binds both TCP ports plus r. Only data leaves: msgspec structs, never pickles.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional
from urllib.parse import urlsplit

import msgspec
import zmq

from framework.config.app import KVEventsConfig
from framework.params.kv_events import AllBlocksCleared, KVEvent, KVEventBatch

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """`endpoint` for data-parallel rank `rank`: a TCP port moves up by the rank; ipc/inproc paths get `-rank`."""
    if rank == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.port is not None:
        host = endpoint[len("tcp://") : endpoint.rindex(":")]
        return f"tcp://{host}:{parts.port + rank}"
    return f"{endpoint}-{rank}"


class KVEventPublisher:
    """Binds the PUB and replay sockets, numbers and buffers batches, answers replay requests."""

    def __init__(self, context: zmq.Context, config: KVEventsConfig, rank: int = 0, num_ranks: int = 1) -> None:
        self._topic = config.topic.encode()
        self._rank = rank if num_ranks > 1 else None
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._pub = context.socket(zmq.PUB)
        self._pub.bind(rank_endpoint(config.endpoint, rank))
        self._replay: Optional[zmq.Socket] = None
        if config.replay_endpoint is not None:
            self._replay = context.socket(zmq.ROUTER)
            self._replay.bind(rank_endpoint(config.replay_endpoint, rank))
        self.publish([AllBlocksCleared()])

    def publish(self, events: list[KVEvent]) -> None:
        """Send one batch (nothing when `events` is empty) and keep it for replay."""
        if not events:
            return
        seq = self._next_seq.to_bytes(8, "big")
        self._next_seq += 1
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self._rank))  # type: ignore[arg-type]
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq, payload))

    def answer_replays(self) -> None:
        """Answer every waiting replay request (non-blocking)."""
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            client, start = frames[0], frames[-1]
            envelope = [client, b""] if len(frames) > 2 else [client]  # REQ clients send an empty delimiter
            if len(start) != 8:
                self._replay.send_multipart([*envelope, END_OF_REPLAY, b""])
                continue
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if int.from_bytes(seq, "big") >= first:
                    self._replay.send_multipart([*envelope, seq, payload])
            self._replay.send_multipart([*envelope, END_OF_REPLAY, b""])

    def close(self) -> None:
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)
