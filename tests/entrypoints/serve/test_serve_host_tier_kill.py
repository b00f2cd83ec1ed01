"""The host KV tier behind `mrv2 serve`, and the engine-core process killed while the tier moves blocks: every
request in flight ends with an error at the client within bounded time (none hangs), `/health` reports the dead
engine, and the server still exits cleanly. Before the kill the server's KV-cache events report the tier's blocks
with medium "CPU".

The device pool holds a few prompts' blocks and eight prefixes rotate through it, so every step of the workload
saves evicted blocks to the tier or loads them back; the kill comes once `/metrics` shows both."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import openai
import pytest
import zmq
from helpers.serve_helpers import ServerProcess

from framework.executor.launch import free_port
from framework.params.kv_events import BlockStored, KVEventBatch

pytestmark = pytest.mark.slow
PREFIXES = [f"# file {i}\n" + f"def f{i}(x{i}): return x{i} * {i} + {i}\n" * 2 for i in range(8)]
CLIENTS = 6


def _counter(server: ServerProcess, name: str, label: str = "") -> float:
    """The sum of counter `name` (its `_total` samples) over the samples whose labels contain `label`."""
    total = 0.0
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(name + "_total{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _client(base_url: str, i: int) -> str:
    """Request after request over the rotating prefixes (streams), until one ends without its normal finish."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    try:
        for k in range(10_000):
            stream = await client.completions.create(
                model="tiny", prompt=PREFIXES[(i + k) % len(PREFIXES)] + str(k), max_tokens=6, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            finished = False
            async for chunk in stream:
                finished = finished or bool(chunk.choices and chunk.choices[0].finish_reason)
            if not finished:
                return "ended"  # the stream closed after an error event
        return "never failed"
    except openai.APIError as err:
        return f"error: {type(err).__name__}"
    finally:
        await client.close()


def test_engine_killed_mid_transfer_fails_every_request_in_bounded_time():
    port = free_port()
    overrides = (
        "cache.enable_prefix_caching=true",
        "cache.block_size=4",
        "cache.num_blocks=40",
        "model.max_model_len=96",
        "cache.host_kv_gib=0.002",
        "scheduler.max_num_seqs=4",
        "serve.kv_events.enabled=true",
        f"serve.kv_events.endpoint=tcp://127.0.0.1:{port}",
        "serve.kv_events.replay_endpoint=null",
    )
    context = zmq.Context()
    with ServerProcess(*overrides) as server:
        sub = context.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        time.sleep(0.3)  # ZMQ's slow joiner

        async def run() -> tuple[list[str], float]:
            tasks = [asyncio.create_task(_client(server.base_url, i)) for i in range(CLIENTS)]
            deadline = time.monotonic() + 120
            while not (
                _counter(server, "mrv2:kv_host_tier_hits") > 0
                and _counter(server, "mrv2:kv_host_tier_bytes", 'direction="to_host"') > 0
            ):
                assert time.monotonic() < deadline, "the workload never used the host tier"
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                await asyncio.sleep(0.2)
            os.kill(server.engine_pid(), signal.SIGKILL)
            killed = time.monotonic()
            endings = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            return endings, time.monotonic() - killed

        try:
            endings, seconds = asyncio.run(run())
            assert all(e == "ended" or e.startswith("error") for e in endings), endings
            assert seconds < 30
            assert server.get("/health").status_code == 503
            decoder = msgspec.msgpack.Decoder(KVEventBatch)
            media = set()
            while sub.poll(300):
                events = decoder.decode(sub.recv_multipart()[2]).events
                media.update(e.medium for e in events if isinstance(e, BlockStored))
            assert media == {"GPU", "CPU"}
            assert server.stop(timeout=30) == 0
        finally:
            context.destroy(linger=0)
