"""The API server's side of the engine core: start and supervise its process, send requests, route outputs.

Every request gets an asyncio queue; a reader task puts each `SequenceDelta` the engine sends for it there, or
a `RequestFailed` when the engine refused the request, died, or the server is shutting down. A monitor task
turns an engine process that exited into failures of every request in flight (nothing waits forever).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, Optional, Sequence, Union

import zmq
import zmq.asyncio

from framework.config.schema import Mrv2Config
from framework.entrypoints.serve.protocol import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineStats,
    SequenceDelta,
    Shutdown,
    front_end_codec,
)
from framework.entrypoints.serve.stream_inbox import ItemSink
from framework.params.lora_request import LoRARequest
from framework.params.pooling_params import PoolingParams
from framework.params.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
MONITOR_INTERVAL_S = 0.2
CORE_MODULE = "framework.entrypoints.serve.engine_core"


class EngineStartError(RuntimeError):
    """The engine core did not come up (its message says why)."""


@dataclass(frozen=True)
class RequestFailed:
    """A request ended without output: `kind` "invalid" (the engine refused it: HTTP 400), "dead" (the engine
    stopped: 503) or "shutdown" (the server is stopping: 503)."""

    message: str
    kind: Literal["invalid", "dead", "shutdown"]


StreamItem = Union[SequenceDelta, RequestFailed]


class RankState(NamedTuple):
    """One engine core as `/load`, `/health` and `/metrics` report it (rank 0 without data parallelism)."""

    rank: int
    dead: Optional[str]  # why it stopped, or None while it runs
    num_in_flight: int  # requests the API server routed to it and still reads
    stats: Optional[EngineStats]  # as of its latest step


class EngineClient:
    """Owns the engine-core process and the two sockets to it."""

    def __init__(
        self,
        config: Mrv2Config,
        rank: int = 0,
        env: Optional[dict[str, str]] = None,
        core_module: str = CORE_MODULE,
        core_args: Sequence[str] = (),
    ) -> None:
        """`rank`: its data-parallel rank; `env`: the engine process's environment (None: this one's);
        `core_module`: the engine-core process's module (`python -m`), given the config, the two socket
        addresses, this process's id, the rank and `core_args`; a stand-in core measures the API server alone."""
        self.config = config
        self.rank = rank
        self._env = env
        self._core = [core_module, *core_args]
        self.info: Optional[EngineReady] = None
        self.stats: Optional[EngineStats] = None
        self.dead: Optional[str] = None  # why the engine is gone, once it is
        self._queues: dict[str, ItemSink[StreamItem]] = {}
        self._codec = front_end_codec()
        self._dir = tempfile.TemporaryDirectory(prefix="mrv2-serve-")
        self._context = zmq.asyncio.Context()
        self._requests = self._context.socket(zmq.PUSH)
        self._outputs = self._context.socket(zmq.PULL)
        self._process: Optional[subprocess.Popen] = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def ranks(self) -> list[RankState]:
        """The engine cores behind this client: this one."""
        return [RankState(self.rank, self.dead, self.num_in_flight, self.stats)]

    async def start(self, timeout_s: float) -> EngineReady:
        """Spawn the engine core and wait until it has loaded the model (or failed, or timed out)."""
        root = Path(self._dir.name)
        input_addr, output_addr = f"ipc://{root / 'requests'}", f"ipc://{root / 'outputs'}"
        self._requests.bind(input_addr)
        self._outputs.bind(output_addr)
        config_path = root / "config.json"
        config_path.write_text(json.dumps(self.config.model_dump(mode="json")))
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                self._core[0],
                str(config_path),
                input_addr,
                output_addr,
                str(os.getpid()),
                str(self.rank),
                *self._core[1:],
            ],
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),
        )  # stdout: the URL line only
        while True:
            if await self._outputs.poll(int(MONITOR_INTERVAL_S * 1000)):
                message = self._codec.decode(await self._outputs.recv())
                if isinstance(message, EngineReady):
                    self.info, self.stats = message, message.stats
                    break
                if isinstance(message, EngineDead):
                    raise EngineStartError(message.message)
            elif self._process.poll() is not None:
                raise EngineStartError(
                    f"the engine process exited with code {self._process.returncode} during start-up (its log is above)"
                )
            timeout_s -= MONITOR_INTERVAL_S
            if timeout_s <= 0:
                raise EngineStartError("the engine did not start in time (serve.engine_start_timeout_s)")
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._monitor())]
        return message

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        queue: ItemSink[StreamItem],
        sampling_params: Optional[SamplingParams] = None,
        pooling_params: Optional[PoolingParams] = None,
        lora: Optional[LoRARequest] = None,
    ) -> None:
        """Queue a request in the engine; its outputs arrive on `queue` (several requests may share one)."""
        if self.dead is not None or self._stopping:
            queue.put_nowait(
                RequestFailed(self.dead or "the server is shutting down", "dead" if self.dead else "shutdown")
            )
            return
        try:
            message = self._codec.encode(
                AddRequest(request_id, prompt_token_ids, sampling_params, pooling_params, lora)
            )
        except OverflowError as err:  # an integer msgpack cannot carry (beyond 64 bits): the engine never sees it
            queue.put_nowait(RequestFailed(f"the request holds an integer out of range: {err}", "invalid"))
            return
        self._queues[request_id] = queue  # only once it is sent: a refused request keeps no place in flight
        self._requests.send(message)

    def abort(self, engine_ids: list[str]) -> None:
        """Abort requests (or single sequences, by child id) in the engine; their slots and blocks free next step."""
        if engine_ids and self.dead is None:
            self._requests.send(self._codec.encode(AbortRequests(engine_ids)))

    def release(self, request_id: str) -> None:
        """The API server is done with a request: its outputs are no longer routed."""
        self._queues.pop(request_id, None)

    def fail_all(self, message: str, kind: Literal["dead", "shutdown"]) -> None:
        """End every request in flight with `RequestFailed` (once per queue)."""
        for queue in {id(q): q for q in self._queues.values()}.values():
            queue.put_nowait(RequestFailed(message, kind))

    async def _read(self) -> None:
        try:
            await self._route()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # an undecodable message: nothing more can be routed, so nothing may wait
            self._mark_dead(f"the engine's output could not be read: {type(err).__name__}: {err}")

    async def _route(self) -> None:
        """Every engine message to its requests' sinks. Each turn drains every message already waiting (no round
        through the event loop per message), then yields once so that every stream writes what it got before
        the next turn. Awaiting a socket that already holds a message does not yield: without the explicit
        yield, a router reading a busy engine would run on while the streams wait, and each stream would then
        get many steps at once."""
        sync = zmq.Socket.shadow(self._outputs.underlying)  # the same socket, for reads that never wait
        while True:
            await self._outputs.poll(flags=zmq.POLLIN)
            while True:
                try:
                    data = sync.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._dispatch(self._codec.decode(data))
            await asyncio.sleep(0)

    def _dispatch(self, message: object) -> None:
        if isinstance(message, EngineOutputs):
            self.stats = message.stats
            for request_id, why in message.rejected:
                sink = self._queues.get(request_id)
                if sink is not None:
                    sink.put_nowait(RequestFailed(why, "invalid"))
            queues = self._queues
            for delta in message.deltas:
                sink = queues.get(delta.request_id)
                if sink is not None:
                    sink.put_nowait(delta)
        elif isinstance(message, EngineDead):
            self._mark_dead(message.message)

    async def _monitor(self) -> None:
        assert self._process is not None
        while self._process.poll() is None:
            await asyncio.sleep(MONITOR_INTERVAL_S)
        if not self._stopping:
            self._mark_dead(f"the engine process exited unexpectedly (code {self._process.returncode})")

    def _mark_dead(self, message: str) -> None:
        if self.dead is None:
            logger.error("mrv2 serve: %s", message)
            self.dead = message
        self.fail_all(self.dead, "dead")

    def begin_shutdown(self) -> None:
        """Stop taking requests and end the ones in flight (their clients get a final error)."""
        if not self._stopping:
            self._stopping = True
            self.fail_all("the server is shutting down", "shutdown")

    async def close(self, timeout_s: float = 5.0) -> None:
        """Tell the engine to stop, wait for its process (killing it after `timeout_s`) and close the sockets."""
        self.begin_shutdown()
        process = self._process
        if process is not None and process.poll() is None:
            self._requests.send(self._codec.encode(Shutdown()))
            for _ in range(int(timeout_s / MONITOR_INTERVAL_S)):
                if process.poll() is not None:
                    break
                await asyncio.sleep(MONITOR_INTERVAL_S)
            else:
                process.kill()
                process.wait()
        for task in self._tasks:
            task.cancel()
        self._requests.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        self._dir.cleanup()
