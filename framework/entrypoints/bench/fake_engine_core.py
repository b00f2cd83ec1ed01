"""A stand-in engine-core process that makes one step of tokens every `--step-ms`, for measuring the API server.

It speaks the real engine-core protocol (`framework.entrypoints.serve.protocol`) on the real sockets, so the API
server under test is the real one end to end: `EngineClient`, `Generation`, the routes, uvicorn, the sockets. It
runs no model: every running request gains one token per step, and the token of step s is the byte
`ord("a") + s % 26`, so a client that reads the text of a stream can tell which step each character came from
(the stream-smoothness test relies on this). Like the real engine core it never waits for the API server: a step
is sent on time whether or not the previous one was read.

Started by `EngineClient(config, core_module=__name__, core_args=["--step-ms", "6"])` as
`python -m framework.entrypoints.bench.fake_engine_core CONFIG_JSON INPUT_ADDR OUTPUT_ADDR PARENT_PID [options]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import msgspec
import zmq

from framework.entrypoints.serve.protocol import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    EngineReady,
    EngineStats,
    SequenceDelta,
    Shutdown,
    engine_codec,
)

FIRST_STEP_BYTE = ord("a")
IDLE_POLL_MS = 50


def step_token(step: int) -> int:
    """The token every running request gains in engine step `step` (a lowercase letter of the byte tokenizer)."""
    return FIRST_STEP_BYTE + step % 26


def _stats(num_running: int) -> EngineStats:
    return EngineStats(num_running, 0, 1, 1, 0, 0, 0, 0, 0)


class FakeCore:
    """The running requests (id -> tokens still to make) and the step clock."""

    def __init__(
        self,
        requests: zmq.Socket,
        outputs: zmq.Socket,
        step_s: float,
        steps_file: Optional[str] = None,
        steps_per_message: int = 1,
    ) -> None:
        """`steps_per_message` > 1 sends that many steps' deltas in one message (each request's in step order),
        every `steps_per_message` steps: what an API server that fell that many steps behind finds waiting, made
        deterministic."""
        self.requests, self.outputs, self.step_s, self.steps_file = requests, outputs, step_s, steps_file
        self.steps_per_message = steps_per_message
        self.codec = engine_codec()
        self.left: dict[str, int] = {}
        self.steps = 0  # steps that produced tokens
        self.stopping = False

    def _handle(self, message: object) -> None:
        if isinstance(message, AddRequest):
            params = message.sampling_params
            self.left[message.request_id] = params.max_tokens if params is not None and params.max_tokens else 16
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.left.pop(request_id, None)
        elif isinstance(message, Shutdown):
            self.stopping = True

    def _receive(self, timeout_ms: int) -> None:
        while self.requests.poll(timeout_ms):
            self._handle(self.codec.decode(self.requests.recv()))
            timeout_ms = 0

    def _step(self) -> None:
        deltas: list[SequenceDelta] = []
        for _ in range(self.steps_per_message):
            token = step_token(self.steps)
            for request_id in list(self.left):
                self.left[request_id] -= 1
                done = self.left[request_id] <= 0
                deltas.append(SequenceDelta(request_id, 0, [token], "length" if done else None))
                if done:
                    del self.left[request_id]
            self.steps += 1
        self.outputs.send(self.codec.encode(EngineOutputs(deltas, _stats(len(self.left)))))

    def _write_steps(self) -> None:
        """The steps made so far, for the harness (written whenever the engine goes idle, and at exit)."""
        if self.steps_file:
            Path(self.steps_file).write_bytes(msgspec.json.encode({"steps": self.steps}))

    def run(self, parent_pid: int) -> None:
        next_step = time.perf_counter()
        while not self.stopping:
            if not self.left:
                self._write_steps()
                self._receive(IDLE_POLL_MS)
                next_step = time.perf_counter()
                if not self.left and os.getppid() != parent_pid:
                    return
                continue
            self._receive(max(0, int((next_step - time.perf_counter()) * 1000)))
            now = time.perf_counter()
            if now < next_step:
                time.sleep(next_step - now)
            if self.left and not self.stopping:
                self._step()
            next_step = max(
                next_step + self.step_s * self.steps_per_message, time.perf_counter()
            )  # late: never catch up in a burst


def main(argv: Optional[list[str]] = None) -> int:
    """`CONFIG_JSON INPUT_ADDR OUTPUT_ADDR PARENT_PID DATA_PARALLEL_RANK [--step-ms MS] [--steps-file PATH]`."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fake_engine_core")
    parser.add_argument("--step-ms", type=float, default=6.0)
    parser.add_argument("--steps-file", default=None, help="where to write the number of steps made so far")
    parser.add_argument("--steps-per-message", type=int, default=1, help="steps sent together (see FakeCore)")
    options = parser.parse_args(args[5:])
    config = json.loads(Path(args[0]).read_text())
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(args[2])
    requests = context.socket(zmq.PULL)
    requests.connect(args[1])
    codec = engine_codec()
    max_model_len = int(config.get("model", {}).get("max_model_len") or 4096)
    outputs.send(codec.encode(EngineReady(max_model_len, 257, None, 20, "fake", _stats(0))))
    core = FakeCore(requests, outputs, options.step_ms / 1000, options.steps_file, options.steps_per_message)
    try:
        core.run(int(args[3]))
    finally:
        core._write_steps()
        outputs.close(linger=1000)
        requests.close(linger=0)
        context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
