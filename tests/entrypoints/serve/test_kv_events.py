"""KV-cache events (docs/scaling-out.md): a real ZMQ subscriber, decoding with its own structs in vLLM's layout,
rebuilds the engine's prefix cache from the events of a workload that evicts; a subscriber that missed batches
gets them from the replay socket; the block hashes are the same in another process with another hash seed."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from framework.config.app import KVEventsConfig
from framework.config.schema import load_config
from framework.engine.core import EngineCore
from framework.entrypoints.serve.kv_events import KVEventPublisher, rank_endpoint
from framework.executor.launch import free_port
from framework.params.kv_events import KVEventRecorder
from framework.params.prefix_cache import ROOT_HASH, hash_block
from framework.params.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 20
TOPIC = "kv-events"


# The subscriber's own copy of the wire layout (what a router written against vLLM declares).
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(_Event):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(_Batch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _prompts() -> list[list[int]]:
    """Four shared prefixes of 3 blocks, each continued three ways: 12 prompts of 22 tokens (the pool of 20
    blocks holds three at a time, so cached blocks are evicted)."""
    out = []
    for p in range(4):
        prefix = [10 + 7 * p + i for i in range(3 * BLOCK)]
        out.extend(prefix + [100 + 11 * p + 3 * k + i for i in range(10)] for k in range(3))
    return out


@pytest.fixture(scope="module")
def engine() -> EngineCore:
    config = load_config(
        {
            "model": {"preset": "random_tiny", "max_model_len": 64},
            "device": "cpu",
            "cache": {"block_size": BLOCK, "num_blocks": NUM_BLOCKS, "enable_prefix_caching": True},
            "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 64},
        }
    )
    core = EngineCore(config)
    yield core
    core.shutdown()


def _subscribe(context: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    time.sleep(0.3)  # the PUB side learns of the subscription asynchronously (ZMQ's slow joiner)
    return sub


def _drain(sub: zmq.Socket, publisher: KVEventPublisher) -> dict[int, KVEventBatch]:
    got = {}
    publisher.answer_replays()
    while sub.poll(200):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode()
        got[int.from_bytes(seq, "big")] = DECODER.decode(payload)
    return got


def _replay(context: zmq.Context, endpoint: str, start: int, publisher: KVEventPublisher) -> dict[int, KVEventBatch]:
    req = context.socket(zmq.DEALER)
    req.connect(endpoint)
    req.send_multipart([b"", start.to_bytes(8, "big")])  # as a REQ socket frames it
    got = {}
    for _ in range(200):
        publisher.answer_replays()
        if not req.poll(50):
            continue
        _, seq, payload = req.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            break
        got[int.from_bytes(seq, "big")] = DECODER.decode(payload)
    else:
        raise AssertionError("no end-of-replay marker")
    req.close(linger=0)
    return got


def _run(engine: EngineCore, publisher: KVEventPublisher, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{len(prompt)}-{i}-{prompt[0]}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.kv_cache.events is not None
        publisher.publish(engine.kv_cache.events.take())


def _rebuild(batches: dict[int, KVEventBatch]) -> tuple[dict[bytes, list[int]], int]:
    """Apply the batches in sequence order: (hash -> its block's tokens, removed blocks seen); checks each stored
    hash against the chain recomputed from the event's own tokens."""
    cache: dict[bytes, list[int]] = {}
    removed = 0
    assert sorted(batches) == list(range(len(batches))), "a gap in the sequence numbers"
    for seq in sorted(batches):
        for event in batches[seq].events:
            if isinstance(event, AllBlocksCleared):
                cache.clear()
            elif isinstance(event, BlockRemoved):
                removed += len(event.block_hashes)
                for h in event.block_hashes:
                    del cache[h]
            else:
                assert event.block_size == BLOCK and event.medium == "GPU"
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                parent = event.parent_block_hash if event.parent_block_hash is not None else ROOT_HASH
                for i, h in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
                    assert h == hash_block(parent, tokens), "a block hash that its tokens do not give"
                    cache[h] = tokens
                    parent = h
    return cache, removed


def test_subscriber_rebuilds_the_prefix_cache_and_replay_fills_gaps(engine: EngineCore) -> None:
    engine.kv_cache.events = KVEventRecorder(BLOCK)
    context = zmq.Context()
    config = KVEventsConfig(
        enabled=True,
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
    )
    publisher = KVEventPublisher(context, config)  # its first batch (seq 0) goes out before anyone listens
    assert config.replay_endpoint is not None
    try:
        sub = _subscribe(context, config.endpoint)
        prompts = _prompts()
        _run(engine, publisher, prompts[:6])
        seen = _drain(sub, publisher)
        sub.close(linger=0)  # offline while the second half runs: those batches are missed
        _run(engine, publisher, prompts[6:9])
        sub = _subscribe(context, config.endpoint)
        _run(engine, publisher, prompts[9:])
        seen.update(_drain(sub, publisher))
        missing = sorted(set(range(max(seen) + 1)) - set(seen))
        assert 0 in missing and len(missing) > 1, missing
        replayed = _replay(context, config.replay_endpoint, 0, publisher)
        assert sorted(replayed) == list(range(max(seen) + 1))
        assert all(msgspec.msgpack.encode(replayed[s]) == msgspec.msgpack.encode(seen[s]) for s in seen)
        cache, removed = _rebuild({**seen, **{s: replayed[s] for s in missing}})
        assert removed > 0, "the workload was meant to evict"
        assert set(cache) == engine.kv_cache.cached_block_hashes()
        first_blocks = {hash_block(ROOT_HASH, p[:BLOCK]): p[:BLOCK] for p in prompts}
        assert any(h in cache for h in first_blocks)
        assert all(cache[h] == tokens for h, tokens in first_blocks.items() if h in cache)
        sub.close(linger=0)
    finally:
        publisher.close()
        context.destroy(linger=0)
        engine.kv_cache.events = None


def test_dropped_removals_are_caught(engine: EngineCore) -> None:
    """Negative control: a recorder that loses BlockRemoved events leaves the rebuilt cache wrong."""
    recorder = KVEventRecorder(BLOCK)
    recorder.removed = lambda block_hash, medium="GPU": None  # type: ignore[method-assign]
    engine.kv_cache.events = recorder
    context = zmq.Context()
    config = KVEventsConfig(enabled=True, endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=None)
    publisher = KVEventPublisher(context, config)
    try:
        sub = _subscribe(context, config.endpoint)
        _run(engine, publisher, [[250 + i for i in range(20)], *_prompts()[:8]])
        got = _drain(sub, publisher)
        events = [e for b in got.values() for e in b.events if isinstance(e, BlockStored)]
        stored = {h for e in events for h in e.block_hashes}
        assert stored != engine.kv_cache.cached_block_hashes()
        sub.close(linger=0)
    finally:
        publisher.close()
        context.destroy(linger=0)
        engine.kv_cache.events = None


def test_block_hashes_do_not_depend_on_the_process() -> None:
    tokens = [5, 6, 7, 8]
    here = hash_block(hash_block(ROOT_HASH, tokens), [1, 2, 3, 4]).hex()
    code = (
        "from framework.params.prefix_cache import ROOT_HASH, hash_block;"
        "print(hash_block(hash_block(ROOT_HASH, [5, 6, 7, 8]), [1, 2, 3, 4]).hex())"
    )
    for seed in ("1", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed}, check=True
        )
        assert out.stdout.strip() == here


def test_rank_endpoints() -> None:
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-1"
