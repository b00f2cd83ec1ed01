"""Two `mrv2 serve` replicas behind a real SGLang Model Gateway (`sglang-router`, cache-aware policy) on 127.0.0.1
(docs/scaling-out.md).

The gateway keeps a character radix tree per replica of the prompts it routed: a prompt matching more than
`--cache-threshold` of a tree goes to that replica, any other to the replica with the fewest requests in flight
(ties: the first). So the first request of each prefix must arrive while the other replica is busy, or every
prefix lands on the first replica: the four prefixes are opened together, then 60 more requests follow. Each
replica's own KV-cache events show which prefixes it cached: each prefix on exactly one, both used. Killing one
replica fails over to the other. The gateway reads each replica's metadata (`/server_info`, `/model_info`) and gets
no 404.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import zmq
from helpers.serve_helpers import ServerProcess

from framework.config.schema import load_config
from framework.executor.launch import free_port
from framework.models.embedded import resolve_model_source
from framework.models.setup import read_model_config
from framework.models.tokenizer import load_tokenizer
from framework.params.kv_events import BlockStored, KVEventBatch
from framework.params.prefix_cache import ROOT_HASH, hash_block

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.slow
BLOCK = 4
WORDS = ("apple", "river", "stone", "cloud")
PREFIXES = [f"{w} " * 12 for w in WORDS]  # 72 characters each; no two share a first character
ROUTER_FLAGS = [
    "--policy", "cache_aware",
    "--cache-threshold", "0.5",  # a follower matches ~95% of its prefix's tree; another prefix matches ~0%
    "--balance-abs-threshold", "64",  # never fall back to shortest-queue within these 64 requests
    "--balance-rel-threshold", "1.5",
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--retry-max-retries", "3",
]  # fmt: skip


def _replica(port: int) -> ServerProcess:
    return ServerProcess(
        f"cache.block_size={BLOCK}",
        "cache.enable_prefix_caching=true",
        "serve.kv_events.enabled=true",
        f"serve.kv_events.endpoint=tcp://127.0.0.1:{port}",
        "serve.kv_events.replay_endpoint=null",
    )


class Router:
    """`python -m sglang_router.launch_router` over `workers` at a free port; ready once it lists them all."""

    def __init__(self, workers: list[str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = tempfile.TemporaryFile(mode="w+")
        port = self.url.rsplit(":", 1)[1]
        argv = ["--worker-urls", *workers, "--host", "127.0.0.1", "--port", port, *ROUTER_FLAGS]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", *argv], stdout=self._log, stderr=self._log
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # workers register in the background after the router listens
            try:
                listed = httpx.get(f"{self.url}/workers", timeout=2).json()
                if len(listed.get("workers", [])) == len(workers):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            assert self.proc.poll() is None, self.log_tail()
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the router did not list its workers\n{self.log_tail()}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def log_tail(self) -> str:
        return self.log()[-3000:]

    def complete(self, prompt: str, max_tokens: int) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def fleet():
    ports = [free_port(), free_port()]
    with _replica(ports[0]) as a, _replica(ports[1]) as b:
        context = zmq.Context()
        subs = []
        for port in ports:
            sub = context.socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.1:{port}")
            sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
            subs.append(sub)
        router = Router([a.url, b.url])
        try:
            yield [a, b], subs, router
        finally:
            router.stop()
            context.destroy(linger=0)


def _stored_hashes(sub: zmq.Socket) -> set[bytes]:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    out: set[bytes] = set()
    while sub.poll(300):
        for event in decoder.decode(sub.recv_multipart()[2]).events:
            if isinstance(event, BlockStored):
                out.update(h for h in event.block_hashes if isinstance(h, bytes))
    return out


def _prefix_hits(server: ServerProcess) -> float:
    line = next(ln for ln in server.get("/metrics").text.splitlines() if ln.startswith("mrv2:prefix_cache_hits_total"))
    return float(line.rsplit(" ", 1)[1])


def test_cache_aware_routing_keeps_each_prefix_on_one_replica_and_uses_both(fleet):
    replicas, subs, router = fleet
    time.sleep(0.3)  # ZMQ's slow joiner: the subscriptions reach the replicas
    with ThreadPoolExecutor(4) as pool:  # the four prefixes open together: each replica busy when the next arrives
        seeds = list(pool.map(lambda p: router.complete(p + "0", max_tokens=8), PREFIXES))
    with ThreadPoolExecutor(8) as pool:
        rest = list(pool.map(lambda i: router.complete(PREFIXES[i % 4] + str(i), max_tokens=1), range(4, 64)))
    assert len(seeds) + len(rest) == 64
    assert all(r["choices"][0]["finish_reason"] == "length" for r in seeds + rest)
    stored = [_stored_hashes(sub) for sub in subs]
    tokenizer = _tokenizer()
    owners = []
    for prefix in PREFIXES:
        first = hash_block(ROOT_HASH, tokenizer.encode(prefix)[:BLOCK])
        on = [i for i in (0, 1) if first in stored[i]]
        assert len(on) == 1, f"prefix {prefix[:12]!r} cached on replicas {on}"
        owners.append(on[0])
    assert set(owners) == {0, 1}, f"every prefix went to one replica: {owners}"
    assert all(_prefix_hits(r) > 0 for r in replicas), "followers hit their prefix's cached blocks"


def test_the_router_reads_each_replica_s_metadata_without_a_404(fleet):
    """The gateway registers a worker from its `/server_info` and `/model_info` (falling back to `/get_server_info`
    and `/get_model_info` on a 404, with a warning in its log): each replica is listed under the served model's
    id with its checkpoint's labels, and the log holds no 404."""
    replicas, _, router = fleet
    assert "returned 404" not in router.log(), router.log_tail()
    listed = httpx.get(f"{router.url}/workers", timeout=5).json()["workers"]
    for worker in listed:  # without the metadata: model id "unknown", no labels
        labels = worker.get("metadata", {})
        assert worker["model_id"] == labels.get("served_model_name") == "tiny", worker
        assert labels["model_type"] == "qwen3" and labels["model_path"].endswith("tiny-code"), worker
    assert sorted(w["url"] for w in listed) == sorted(r.url for r in replicas)


def _tokenizer():  # type: ignore[no-untyped-def]
    """The replicas' tokenizer (the embedded tiny model's), without building an engine."""
    config = load_config({"device": "cpu"})
    return load_tokenizer(resolve_model_source(config.model.path, config.model.preset).path, read_model_config(config))


def test_killing_a_replica_fails_over(fleet):
    replicas, _, router = fleet
    os.kill(replicas[1].proc.pid, signal.SIGKILL)
    replicas[1].proc.wait(30)
    _wait_until_the_router_drops(router, replicas[1].url)
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: router.complete(PREFIXES[i % 4] + f"x{i}", max_tokens=2), range(8)))
    assert all(r["choices"][0]["finish_reason"] == "length" for r in got)
    assert time.monotonic() - start < 60


def _wait_until_the_router_drops(router: Router, url: str) -> None:
    """Until the router's health check has taken `url` out of rotation (listed unhealthy, or no longer listed), at
    most 30 s: requests sent before that are routed to the dead replica and answered 500 by the router itself."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = httpx.get(f"{router.url}/workers", timeout=2).json().get("workers", [])
        mine = [w for w in listed if isinstance(w, dict) and url in str(w.get("url", ""))]
        if not mine or any(w.get("is_healthy") is False or w.get("healthy") is False for w in mine):
            return
        time.sleep(0.2)
