"""The engine-core process of `mrv2 serve`: the scheduler and runner loop, and nothing else.

It reads typed requests from one ZMQ socket and writes one message per engine step to another: no HTTP, no
text. Requests run with `output_kind="delta"` and without detokenization or stop strings (the API server
does text), so each step's output is a list of token-id deltas. Started by `EngineProcess` in the API server
as `python -m framework.entrypoints.serve.engine_core CONFIG_JSON INPUT_ADDR OUTPUT_ADDR`; it exits when told to, when
its
parent goes away, or when the engine dies (after sending `EngineDead`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import zmq

from framework.config.schema import load_config
from framework.engine.core import EngineCore
from framework.engine.failure import EngineDeadError
from framework.engine.request import Logprob, RequestOutput
from framework.entrypoints.serve.kv_events import KVEventPublisher
from framework.entrypoints.serve.protocol import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineStats,
    SequenceDelta,
    Shutdown,
    TokenLogprobs,
    engine_codec,
)
from framework.params.kv_events import KVEventRecorder
from framework.params.pooling_params import PoolingRequestOutput
from framework.params.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 50  # how long an idle engine waits for a message before it checks on its parent


def lora_targets_message(engine: EngineCore) -> tuple[list[tuple[int, str, int, int]], list[int]]:
    """`EngineReady`'s LoRA fields: the projections adapters may update, and the MoE layers."""
    targets = engine.lora_catalog.targets
    if targets is None:
        return [], []
    shapes = [(layer, part, s.in_features, s.out_features) for (layer, part), s in sorted(targets.shapes.items())]
    return shapes, sorted(targets.moe_layers)


def engine_stats(engine: EngineCore) -> EngineStats:
    """The engine's gauges and counters, as the API server's /metrics reports them."""
    scheduler, spec = engine.scheduler, engine.spec_metrics
    prefix, tier = engine.kv_cache.stats, engine.kv_tier_stats
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_blocks=engine.kv_cache.num_blocks,
        num_free_blocks=engine.kv_cache.num_free_blocks,
        prefix_cache_queries=prefix.queries,
        prefix_cache_hits=prefix.hits,
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        kv_tier_hit_tokens=tier.hit_tokens,
        kv_tier_failed_loads=tier.failed_loads,
        kv_tier_bytes_to_host=tier.bytes_to_tier,
        kv_tier_bytes_to_device=tier.bytes_to_device,
        kv_tier_loads=tier.num_loads,
        kv_tier_load_seconds=tier.load_seconds,
        kv_tier_blocks_held=tier.blocks_held,
        kv_tier_snapshot_hits=tier.snapshot_hits,
        kv_tier_snapshots_held=tier.snapshots_held,
    )


def _token_logprobs(entry: dict[int, Logprob]) -> TokenLogprobs:
    """{token: Logprob} (the sampled token first) as (token, logprob, rank) tuples."""
    return [(token, lp.logprob, lp.rank if lp.rank is not None else 0) for token, lp in entry.items()]


def to_delta(out: RequestOutput | PoolingRequestOutput) -> SequenceDelta:
    """One engine output (a delta: `output_kind="delta"`) as a wire message."""
    if isinstance(out, PoolingRequestOutput):
        return SequenceDelta(
            out.request_id,
            0,
            [],
            out.finish_reason,
            None,
            error=out.error,
            embedding=out.embedding if out.finish_reason == "pooled" else None,
        )
    return SequenceDelta(
        out.request_id,
        out.index,
        out.token_ids,
        out.finish_reason if out.finished else None,
        out.stop_reason,
        logprobs=[_token_logprobs(e) for e in out.logprobs] if out.logprobs is not None else None,
        prompt_logprobs=(
            [None if e is None else _token_logprobs(e) for e in out.prompt_logprobs]
            if out.prompt_logprobs is not None
            else None
        ),
        num_cached_tokens=out.num_cached_tokens,
        error=out.error,
    )


class EngineCoreLoop:
    """Between engine steps: take every queued message, then step while there is work."""

    def __init__(
        self,
        engine: EngineCore,
        requests: zmq.Socket,
        outputs: zmq.Socket,
        kv_events: Optional[KVEventPublisher] = None,
    ) -> None:
        self.engine = engine
        self.requests = requests
        self.outputs = outputs
        self.kv_events = kv_events
        self.codec = engine_codec()
        self._rejected: list[tuple[str, str]] = []
        self._stopping = False

    def _handle(self, message: object) -> None:
        if isinstance(message, AddRequest):
            try:
                params = message.sampling_params
                if params is not None:  # the API server does text: tokens only, streamed as deltas
                    params = dataclasses.replace(params, output_kind="delta", detokenize=False, stop=None)
                self.engine.add_request(
                    message.request_id,
                    message.prompt_token_ids,
                    params,
                    pooling_params=message.pooling_params,
                    lora_request=message.lora,
                )
            except InvalidRequestError as err:
                self._rejected.append((message.request_id, str(err)))
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.engine.abort_request(request_id)
        elif isinstance(message, Shutdown):
            self._stopping = True

    def _receive(self, timeout_ms: int) -> bool:
        """Handle every message waiting (waiting up to `timeout_ms` for the first); True if any came."""
        got = False
        while self.requests.poll(timeout_ms):
            self._handle(self.codec.decode(self.requests.recv()))
            got, timeout_ms = True, 0
        return got

    def _publish_kv_events(self) -> None:
        recorder = self.engine.kv_cache.events
        if self.kv_events is not None and recorder is not None:
            self.kv_events.publish(recorder.take())
            self.kv_events.answer_replays()

    def _send(self, deltas: list[SequenceDelta]) -> None:
        self._publish_kv_events()
        rejected, self._rejected = self._rejected, []
        self.outputs.send(self.codec.encode(EngineOutputs(deltas, engine_stats(self.engine), rejected)))

    def run(self, parent_pid: int) -> None:
        while not self._stopping:
            busy = self.engine.has_unfinished_requests()
            got = self._receive(0 if busy else IDLE_POLL_MS)
            if self._stopping:
                break
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                self._send([to_delta(o) for o in outputs])
            elif got:  # aborts or refusals while idle: the counters changed
                self._send([])
            elif os.getppid() != parent_pid:  # the API server is gone: nobody reads our outputs
                logger.warning("mrv2 engine core: the API server process exited; stopping")
                break
            else:
                self._publish_kv_events()  # answer replay requests while idle
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort_request(request_id)


def main(argv: Optional[list[str]] = None) -> int:
    """Process entry point: `CONFIG_JSON INPUT_ADDR OUTPUT_ADDR [PARENT_PID [DATA_PARALLEL_RANK]]`."""
    args = list(sys.argv[1:] if argv is None else argv)
    config_path, input_addr, output_addr = args[:3]
    parent = args[3] if len(args) > 3 else ""
    dp_rank = int(args[4]) if len(args) > 4 else 0
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_addr)
    codec = engine_codec()
    kv_events: Optional[KVEventPublisher] = None
    try:
        config = load_config(json.loads(Path(config_path).read_text()))
        engine = EngineCore(config)
        if config.serve.kv_events.enabled:
            engine.kv_cache.events = KVEventRecorder(config.cache.block_size)
            engine.kv_connector.set_kv_events(engine.kv_cache.events)  # a host tier's blocks: medium "CPU"
            kv_events = KVEventPublisher(context, config.serve.kv_events, dp_rank, config.parallel.data_parallel_size)
    except BaseException as err:  # start-up failure: tell the API server why, then exit
        outputs.send(codec.encode(EngineDead(f"the engine failed to start: {type(err).__name__}: {err}")))
        outputs.close(linger=2000)
        return 1
    requests = context.socket(zmq.PULL)
    requests.connect(input_addr)
    outputs.send(
        codec.encode(
            EngineReady(
                engine.max_model_len,
                engine.loaded.vocab_size,
                engine.loaded.eos_token_id,
                config.sampler.max_logprobs,
                engine.runner.name,
                engine_stats(engine),
                *lora_targets_message(engine),
            )
        )
    )
    loop = EngineCoreLoop(engine, requests, outputs, kv_events)
    code = 0
    try:
        loop.run(int(parent) if parent else os.getppid())
    except EngineDeadError as err:
        outputs.send(codec.encode(EngineDead(str(err))))
        code = 1
    except Exception as err:
        logger.exception("mrv2 engine core failed")
        outputs.send(codec.encode(EngineDead(f"the engine core failed: {type(err).__name__}: {err}")))
        code = 1
    finally:
        engine.shutdown()
        if kv_events is not None:
            kv_events.close()
        outputs.close(linger=2000)
        requests.close(linger=0)
        context.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
