"""`mrv2 serve parallel.data_parallel_size=2` on the CPU: two engine-core processes behind one API server.

Texts equal offline `LLM.generate` on one engine (greedy); concurrent requests spread over both ranks and each
shared prefix stays on one rank (seen in each rank's own KV-cache events, port + rank); an abandoned stream
frees its rank's blocks; killing one rank fails only its requests, `/health` reports it and the other serves.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import openai
import pytest
import zmq
from helpers.serve_helpers import ServerProcess, openai_client

from framework import LLM, SamplingParams
from framework.executor.launch import free_port
from framework.params.kv_events import BlockStored, KVEventBatch
from framework.params.prefix_cache import ROOT_HASH, hash_block

pytestmark = pytest.mark.slow
BLOCK = 4
PREFIXES = ["def fibonacci(n):\n    ", "import numpy as np\nimport os\n", "class Stack:\n    def push"]
PROMPTS = [p + tail for p in PREFIXES for tail in ("a", "b", "c")]
PORT = free_port()


@pytest.fixture(scope="module")
def server():
    with ServerProcess(
        "parallel.data_parallel_size=2",
        f"cache.block_size={BLOCK}",
        "cache.enable_prefix_caching=true",
        "serve.kv_events.enabled=true",
        f"serve.kv_events.endpoint=tcp://127.0.0.1:{PORT}",
        "serve.kv_events.replay_endpoint=null",
    ) as s:
        yield s


def _rank_pids(server: ServerProcess) -> dict[int, int]:
    """rank -> pid of the server's engine-core children (the rank is their last argument)."""
    pids = {}
    assert server.proc is not None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            int(stat.rsplit(")", 1)[1].split()[1]) == server.proc.pid
            and b"framework.entrypoints.serve.engine_core" in argv
        ):
            pids[int([a for a in argv if a][-1])] = int(entry.name)
    return pids


def _events(context: zmq.Context, rank: int) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{PORT + rank}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    return sub


def _stored_hashes(sub: zmq.Socket) -> set[bytes]:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    out: set[bytes] = set()
    while sub.poll(300):
        _, _, payload = sub.recv_multipart()
        for event in decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                out.update(h for h in event.block_hashes if isinstance(h, bytes))
    return out


def test_texts_equal_one_engine_and_prefixes_stay_on_one_rank(server):
    client = openai_client(server, timeout=600)
    offline = LLM("tiny", device="cpu")
    want = [o.text for o in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    tokenizer = offline.tokenizer
    offline.shutdown()
    context = zmq.Context()
    subs = [_events(context, rank) for rank in (0, 1)]
    time.sleep(0.5)  # ZMQ's slow joiner: the subscriptions reach the engines
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(
                pool.map(
                    lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0),
                    PROMPTS,
                )
            )
        assert [g.choices[0].text for g in got] == want
        stored = [_stored_hashes(sub) for sub in subs]
    finally:
        context.destroy(linger=0)
    assert stored[0] and stored[1], "both ranks served requests"
    for prefix in PREFIXES:
        first = hash_block(ROOT_HASH, tokenizer.encode(prefix)[:BLOCK])
        assert (first in stored[0]) != (first in stored[1]), f"prefix {prefix!r} cached on both ranks or none"
    load = server.get("/load").json()
    assert [r["alive"] for r in load["data_parallel"]] == [True, True]


def test_an_abandoned_stream_frees_its_ranks_blocks(server):
    client = openai_client(server, timeout=600)
    stream = client.completions.create(
        model="tiny", prompt="def long(x):", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    busy = server.get("/load").json()["data_parallel"]
    assert sum(r["kv_cache_usage_perc"] > 0 for r in busy) == 1, busy
    stream.close()
    for _ in range(100):
        ranks = server.get("/load").json()["data_parallel"]
        if all(r["server_load"] == 0 and r["kv_cache_usage_perc"] == 0 for r in ranks):
            break
        time.sleep(0.1)
    assert all(r["kv_cache_usage_perc"] == 0 and r["num_requests_running"] == 0 for r in ranks), ranks


def test_a_killed_rank_fails_only_its_requests(server):
    client = openai_client(server, timeout=600)
    results: dict[int, object] = {}

    def stream(i: int) -> None:
        try:
            chunks = client.completions.create(
                model="tiny", prompt=f"def f{i}(x):", max_tokens=48, stream=True, extra_body={"ignore_eos": True}
            )
            results[i] = sum(1 for _ in chunks)
        except openai.APIError as err:
            results[i] = err

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for _ in range(600):  # both requests running, one per rank
        if all(r["num_requests_running"] == 1 for r in server.get("/load").json()["data_parallel"]):
            break
        time.sleep(0.1)
    os.kill(_rank_pids(server)[1], signal.SIGKILL)
    for t in threads:
        t.join(300)
    failed = [r for r in results.values() if isinstance(r, Exception)]
    assert len(results) == 2 and len(failed) == 1, results
    health = server.get("/health")
    assert health.status_code == 200 and "rank 1" in health.headers["x-mrv2-degraded"]
    assert [r["alive"] for r in server.get("/load").json()["data_parallel"]] == [True, False]
    again = client.completions.create(model="tiny", prompt="def g(x):", max_tokens=4)
    assert again.choices[0].finish_reason == "length"
