"""`mrv2 serve` under bounded concurrent load: disconnecting clients free their slots and blocks, and an engine
process that dies mid-load ends every request with an error instead of a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
from helpers.serve_helpers import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
NUM_CLIENTS = 48
NUM_DISCONNECTING = 12
MAX_TOKENS = 40


def _gauges(server) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            out[sample.name] = sample.value
    return out


async def _client(base_url: str, i: int, disconnect: bool) -> tuple[int, str, int]:
    """Stream one completion; a disconnecting client leaves after 3 chunks. Returns (tokens seen, finish, chunks)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
    stream = await client.completions.create(
        model="tiny",
        prompt=f"def f{i}(x):",
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=i,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    chunks, finish, tokens = 0, "", 0
    async for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if disconnect and chunks == 3:
            await stream.close()
            break
    await client.close()
    return tokens, finish, chunks


def test_concurrent_streams_with_disconnects_free_everything():
    with ServerProcess("scheduler.max_num_seqs=64") as server:

        async def run() -> list:
            return await asyncio.wait_for(
                asyncio.gather(*[_client(server.base_url, i, i % 4 == 0) for i in range(NUM_CLIENTS)]), timeout=240
            )

        results = asyncio.run(run())
        full = [r for i, r in enumerate(results) if i % 4 != 0]
        assert len(full) == NUM_CLIENTS - NUM_DISCONNECTING
        assert all(tokens == MAX_TOKENS and finish == "length" for tokens, finish, _ in full), full
        deadline = time.monotonic() + 20
        while True:
            g = _gauges(server)
            idle = (
                g["mrv2:num_requests_running"] == 0
                and g["mrv2:num_requests_waiting"] == 0
                and g["mrv2:kv_cache_blocks_free"] == g["mrv2:kv_cache_blocks_total"]
            )
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert idle, g
        assert g["mrv2:kv_cache_usage_perc"] == 0.0
        again = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        assert again.completions.create(model="tiny", prompt="x = ", max_tokens=3).usage.completion_tokens == 3


async def _until_end(base_url: str, i: int) -> str:
    """Stream until the server ends the request; returns how it ended."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    try:
        stream = await client.completions.create(
            model="tiny", prompt=f"class C{i}:", max_tokens=900, stream=True, extra_body={"ignore_eos": True}
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                return "finished"
        return "ended"  # the stream closed after an error event
    except openai.APIError as err:
        return f"error: {type(err).__name__}"
    finally:
        await client.close()


def test_engine_death_mid_load_fails_requests_and_health():
    with ServerProcess() as server:

        async def run() -> list[str]:
            tasks = [asyncio.create_task(_until_end(server.base_url, i)) for i in range(8)]
            await asyncio.sleep(1.5)  # the streams are running
            os.kill(server.engine_pid(), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)

        endings = asyncio.run(run())
        assert "finished" not in endings  # nobody got a normal end: everyone got the failure
        assert server.get("/health").status_code == 503
        r = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert server.stop(timeout=30) == 0


def test_tensor_parallel_engine_behind_the_server():
    """TP=2 over gloo on the CPU behind the server: the same greedy text as one process offline."""
    from framework import LLM, SamplingParams

    want = (
        LLM("tiny", device="cpu")
        .generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        .text
    )
    with ServerProcess("parallel.tensor_parallel_size=2") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
        got = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=12, temperature=0)
        assert got.choices[0].text == want
        assert server.stop(timeout=30) == 0


def test_a_stream_that_leaves_before_its_first_token_is_aborted():
    """A queued stream whose client goes away before any token leaves the engine's queue (no slot, no blocks)."""
    import json
    import socket

    import httpx

    with ServerProcess("scheduler.max_num_seqs=1") as server:
        body = {"prompt": "def long(x):", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as running:
            lines = running.iter_lines()  # kept: a dropped iterator would close this stream
            assert next(lines).startswith("data: ")  # it holds the only slot
            host, port = server.url.removeprefix("http://").split(":")
            payload = json.dumps(body).encode()
            queued = socket.create_connection((host, int(port)), timeout=10)  # answered only at its first token
            queued.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(payload) + payload
            )
            deadline = time.monotonic() + 10
            while _gauges(server)["mrv2:num_requests_waiting"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            g = _gauges(server)
            assert g["mrv2:num_requests_waiting"] == 1, (g, server.stderr_tail())
            queued.close()  # the client leaves before its first token
            deadline = time.monotonic() + 10
            while _gauges(server)["mrv2:num_requests_waiting"] > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            g = _gauges(server)
            assert g["mrv2:num_requests_waiting"] == 0 and g["mrv2:num_requests_running"] == 1
