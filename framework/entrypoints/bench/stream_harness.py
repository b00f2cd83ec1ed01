"""The API-server harness: the real `mrv2 serve` front end, a stand-in engine core, real streaming clients.

`python -m framework.entrypoints.bench.stream_harness --streams 256 --tokens 200 --step-ms 6 --runs 3 [--profile]`

One server process runs the real app (uvicorn, routes, `Generation`, `EngineClient`) whose engine core is
`fake_engine_core` (one token per running request every `--step-ms`, never waiting for the server); this process
streams `--streams` completions at once over 127.0.0.1. Reported per run: the server's CPU time per engine step
(what one API-server core must fit into the engine's step time), the inter-event gap percentiles and tokens per
event a user sees; with `--profile`, the server's cProfile time split by where it goes (docs/serving_streams.md).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from framework.config.schema import Mrv2Config, load_config
from framework.entrypoints.bench import fake_engine_core
from framework.entrypoints.bench.stream_client import StreamRecord, completion_body, stream_completion
from framework.entrypoints.serve.engine_client import EngineClient
from framework.entrypoints.serve.server import serve_command

MODULE = "framework.entrypoints.bench.stream_harness"
# Where the API server's time goes: the first pattern found in a profile row's "file:function" names its part.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("detokenization", ("detokenizer.py", "tokenizer.py", "sequence_text.py")),
    ("JSON / SSE encoding", ("json/", "responses.py:sse", "orjson", "msgspec", "stream_frames.py")),
    ("output processing", ("generation.py", "openai_routes.py", "chat_tools.py", "streaming.py", "stream_inbox.py")),
    ("engine messages (ZMQ, decode, routing)", ("engine_client.py", "zmq/", "protocol.py")),
    ("HTTP framing and socket writes", ("uvicorn/", "h11", "httptools", "starlette/", "selector_events.py")),
    ("event loop and tasks", ("asyncio/", "uvloop", "<built-in method select", "<method 'poll'")),
)


def part_of(where: str) -> str:
    """The part of the server a profile row (`file:line(function)`) belongs to."""
    for part, patterns in PARTS:
        if any(p in where for p in patterns):
            return part
    return "other"


def profile_split(path: Path) -> dict[str, float]:
    """A cProfile dump's own (tottime) seconds per part, largest first. A built-in function's time goes to the
    parts of its callers, in proportion to the time each caller spent in it."""
    stats = pstats.Stats(str(path))
    parts: dict[str, float] = {}
    for (file, _, function), row in stats.stats.items():  # type: ignore[attr-defined]
        callers = row[4]
        if file == "~" and callers:
            for (caller_file, _, caller_function), caller_row in callers.items():
                part = part_of(f"{caller_file}:{caller_function}")
                parts[part] = parts.get(part, 0.0) + caller_row[2]
            continue
        part = part_of(f"{file}:{function}")
        parts[part] = parts.get(part, 0.0) + row[2]
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class HarnessRun:
    """One load: every stream at once, to its end."""

    streams: int
    steps: int
    server_cpu_s: float
    gap_p50_ms: float
    gap_p99_ms: float
    tokens_per_event: float
    tokens_per_http_chunk: float
    seconds: float
    client_cpu_s: float  # this process's (the clients') CPU: near `seconds` means the clients limit the run

    tokens: int  # every stream's tokens together (one per stream per step)

    @property
    def cpu_us_per_token(self) -> float:
        """The server's CPU per streamed token (request set-up included, amortized over the stream)."""
        return 1e6 * self.server_cpu_s / max(self.tokens, 1)

    @property
    def cpu_ms_per_step(self) -> float:
        """The server's CPU for one engine step of all `streams` (one token each): what must fit in a step."""
        return self.cpu_us_per_token * self.streams / 1000


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (its children not counted)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class HarnessServer:
    """The server process (real app, stand-in engine core) on 127.0.0.1 at a free port."""

    def __init__(
        self,
        step_ms: float,
        max_num_seqs: int,
        workdir: Path,
        profile: Optional[Path] = None,
        steps_per_message: int = 1,
    ) -> None:
        self.workdir = workdir
        self.steps_file = workdir / "steps.json"
        config = load_config(  # the nano bench's model: its server detokenizes with the byte tokenizer
            {
                "device": "cpu",
                "model": {"preset": "qwen3-0.6b", "max_model_len": 2048},
                "serve": {"port": 0},
                "scheduler": {"max_num_seqs": max_num_seqs},
            }
        )
        (workdir / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
        command = [sys.executable, "-m", MODULE, "serve", str(workdir / "config.json"), "--step-ms", str(step_ms)]
        command += ["--steps-file", str(self.steps_file), "--steps-per-message", str(steps_per_message)]
        command += ["--profile", str(profile)] if profile else []
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("mrv2 serve: "):
            self.proc.kill()
            raise RuntimeError(f"the harness server did not start: {line!r}")
        host_port = line.split()[2].rsplit("/", 1)[-1]
        self.host, self.port = host_port.rsplit(":", 1)[0], int(host_port.rsplit(":", 1)[1])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _load(server: HarnessServer, streams: int, tokens: int, keep_text: bool) -> list[StreamRecord]:
    bodies = [completion_body([97 + i % 26, 98], tokens, 0.0, i) for i in range(streams)]
    return await asyncio.gather(
        *[stream_completion(server.host, server.port, b, keep_text=keep_text, timeout_s=300) for b in bodies]
    )


def run_load(server: HarnessServer, streams: int, tokens: int, keep_text: bool = False) -> tuple[HarnessRun, list]:
    """Stream `streams` completions of `tokens` tokens at once; the run's numbers and every stream's record."""
    steps_before = _steps(server)
    cpu_before, begin, client_before = _cpu_s(server.proc.pid), time.perf_counter(), time.process_time()
    records = asyncio.run(_load(server, streams, tokens, keep_text))
    seconds, cpu = time.perf_counter() - begin, _cpu_s(server.proc.pid) - cpu_before
    client_cpu = time.process_time() - client_before
    gaps = [g for r in records for g in r.gaps_s]
    num_tokens = sum(r.completion_tokens for r in records)
    run = HarnessRun(
        streams,
        _steps_since(server, steps_before),
        cpu,
        1000 * _percentile(gaps, 0.5),
        1000 * _percentile(gaps, 0.99),
        num_tokens / max(1, sum(len(r.event_times) for r in records)),
        num_tokens / max(1, sum(r.num_http_chunks for r in records)),
        seconds,
        client_cpu,
        num_tokens,
    )
    return run, records


def _steps(server: HarnessServer) -> int:
    """The steps the stand-in core has made (it writes the count whenever it goes idle)."""
    try:
        return int(json.loads(server.steps_file.read_text())["steps"])
    except (OSError, ValueError, KeyError):
        return 0


def _steps_since(server: HarnessServer, before: int) -> int:
    for _ in range(100):  # the core writes its count a moment after the last stream ends
        if _steps(server) > before:
            break
        time.sleep(0.02)
    return _steps(server) - before


def format_runs(label: str, step_ms: float, runs: list[HarnessRun]) -> str:
    """One table row: medians over the runs."""
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    return (
        f"| {label} | {runs[0].streams} | {step_ms:g} | {med(lambda r: r.cpu_us_per_token):.1f} "
        f"| {med(lambda r: r.cpu_ms_per_step):.2f} | {med(lambda r: r.gap_p50_ms):.1f} "
        f"| {med(lambda r: r.gap_p99_ms):.1f} | {med(lambda r: r.tokens_per_event):.2f} "
        f"| {med(lambda r: r.tokens_per_http_chunk):.2f} |"
    )


TABLE_HEAD = (
    "| server | streams | step ms | CPU µs / token | CPU ms / step | gap p50 ms | gap p99 ms | tokens / event "
    "| tokens / HTTP chunk |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _serve(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="stream_harness serve")
    parser.add_argument("config")
    parser.add_argument("--step-ms", default="6")
    parser.add_argument("--steps-file", required=True)
    parser.add_argument("--steps-per-message", default="1")
    parser.add_argument("--profile", default=None)
    options = parser.parse_args(argv)
    config = load_config(json.loads(Path(options.config).read_text()))
    core_args = ["--step-ms", options.step_ms, "--steps-file", options.steps_file]
    core_args += ["--steps-per-message", options.steps_per_message]

    def client(c: Mrv2Config) -> EngineClient:
        return EngineClient(c, core_module=fake_engine_core.__name__, core_args=core_args)

    profiler = cProfile.Profile(time.process_time) if options.profile else None  # CPU, not waits
    if profiler is not None:
        profiler.enable()
    try:
        serve_command(config, client)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(options.profile)


def main(argv: Optional[list[str]] = None) -> None:
    """`serve CONFIG ...` (the server process), else the harness itself."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        return _serve(args[1:])
    parser = argparse.ArgumentParser(prog="stream_harness")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=6.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile the server (slower) and split its time")
    parser.add_argument("--label", default="mrv2 serve")
    options = parser.parse_args(args)
    with tempfile.TemporaryDirectory(prefix="mrv2-stream-harness-") as tmp:
        profile = Path(tmp) / "server.prof" if options.profile else None
        server = HarnessServer(options.step_ms, max(options.streams, 1), Path(tmp), profile)
        try:
            run_load(server, min(options.streams, 16), 8)  # warm-up
            runs = [run_load(server, options.streams, options.tokens)[0] for _ in range(options.runs)]
        finally:
            server.stop()
        print(TABLE_HEAD)
        print(format_runs(options.label, options.step_ms, runs))
        for r in runs:
            print(json.dumps({**r.__dict__, "cpu_ms_per_step": r.cpu_ms_per_step}), file=sys.stderr)
        if profile is not None:
            split = profile_split(profile)
            total = sum(split.values())
            print("\n| where the server's time goes (cProfile, all runs) | share |\n|---|---:|")
            for part, seconds in split.items():
                print(f"| {part} | {100 * seconds / total:.0f}% |")
            pstats.Stats(str(profile)).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
