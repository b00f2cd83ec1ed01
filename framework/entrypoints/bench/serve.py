"""`mrv2 bench experiment=serve_nano`: the bench's requests through the HTTP API, against offline on the same run.

First the workload runs offline (`LLM.generate`, as `mrv2 bench` does); then the same process starts `mrv2 serve`
on the same config in a child process and sends the same requests as streaming completions (token-id prompts,
`ignore_eos`): all at once, at each Poisson rate of `bench.request_rates`, then closed-loop at each of
`bench.concurrencies` (that many users, each sending its next request when its stream ends). Reported per run
(`serve_report`): output tok/s, TTFT and TPOT per request, the gap between a stream's events and tokens per event
(what a reader of one stream sees), goodput under `bench.slo_ttft_ms` / `bench.slo_tpot_ms`, and per-user
against per-GPU throughput.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

from framework.config.schema import Mrv2Config
from framework.entrypoints.bench.serve_report import ServedRun, format_serve_table, summarize, write_serve_results
from framework.entrypoints.bench.stream_client import StreamRecord, completion_body, stream_completion
from framework.entrypoints.bench.throughput import Workload, bench_mrv2, make_workload
from framework.entrypoints.llm import LLM

__all__ = ["ServedRun", "format_serve_table", "run_serve_bench"]


def _bodies(workload: Workload, temperature: float, seed: int) -> list[bytes]:
    return [
        completion_body(p, n, temperature, seed + i)
        for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))
    ]


async def _rate_run(host: str, port: int, bodies: list[bytes], rate: float, seed: int) -> list[StreamRecord]:
    """Every request, at Poisson arrivals of `rate` per second (inf: all at once)."""
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in bodies:
        delays.append(t)
        t += rng.expovariate(rate) if math.isfinite(rate) else 0.0
    return await asyncio.gather(*[stream_completion(host, port, b, d) for b, d in zip(bodies, delays)])


async def _closed_loop(host: str, port: int, bodies: list[bytes], users: int) -> list[StreamRecord]:
    """`users` clients, each sending the next request as soon as its stream ends, until none is left."""
    queue = list(reversed(bodies))
    records: list[StreamRecord] = []

    async def user() -> None:
        while queue:
            records.append(await stream_completion(host, port, queue.pop()))

    await asyncio.gather(*[user() for _ in range(users)])
    return records


def _timed(coroutine) -> tuple[list[StreamRecord], float]:  # type: ignore[no-untyped-def]
    begin = time.perf_counter()
    records = _run_async(coroutine)
    return records, time.perf_counter() - begin


def _run_async(coroutine):  # type: ignore[no-untyped-def]
    """asyncio.run, on uvloop when it is installed (a faster client)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _start_server(config: Mrv2Config, workdir: Path) -> tuple[subprocess.Popen, str]:
    path = workdir / "serve_config.json"
    served = config.model_copy(update={"serve": config.serve.model_copy(update={"port": 0})})
    path.write_text(json.dumps(served.model_dump(mode="json")))
    proc = subprocess.Popen(
        [sys.executable, "-m", "framework.entrypoints.serve.server", str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("mrv2 serve: "):
        proc.kill()
        raise RuntimeError(f"the server did not start (its log is above): {line!r}")
    return proc, line.split()[2]


def _served_runs(config: Mrv2Config, base: str, workload: Workload, vocab: int) -> list[ServedRun]:
    bench = config.bench
    url = urlsplit(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    warm = make_workload(
        bench.model_copy(
            update={"num_requests": max(bench.warmup_requests, 1), "seed": bench.seed + 1, "output_len": (8, 16)}
        ),
        vocab,
    )
    _run_async(_rate_run(host, port, _bodies(warm, bench.temperature, bench.seed), math.inf, bench.seed))
    bodies = _bodies(workload, bench.temperature, bench.seed)
    runs: list[ServedRun] = []
    for rate in [math.inf, *bench.request_rates]:
        records, seconds = _timed(_rate_run(host, port, bodies, rate, bench.seed))
        label = "all at once" if not math.isfinite(rate) else f"{rate:g} req/s"
        runs.append(summarize(label, records, seconds, bench, rate=rate))
        _progress(runs[-1])
    for users in bench.concurrencies:
        some = bodies[: min(len(bodies), users * bench.requests_per_user)]
        records, seconds = _timed(_closed_loop(host, port, some, users))
        runs.append(summarize(f"{users} users", records, seconds, bench, concurrency=users))
        _progress(runs[-1])
    return runs


def _progress(run: ServedRun) -> None:
    print(f"served ({run.label}): {run.output_tok_per_s:,.0f} output tok/s", file=sys.stderr)


def run_serve_bench(config: Mrv2Config, out_dir: Path) -> list[ServedRun]:
    """Offline, then served (all at once, each rate, each concurrency); table, bench.json, bench.png."""
    bench = config.bench
    llm = LLM(config=config)
    vocab = llm.engine.loaded.vocab_size
    workload = make_workload(bench, vocab)
    offline = bench_mrv2(llm, workload, bench)
    print(f"offline: {offline.output_tok_per_s:,.0f} output tok/s", file=sys.stderr)
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the server's engine gets the device memory back
    with tempfile.TemporaryDirectory(prefix="mrv2-bench-serve-") as tmp:
        proc, base = _start_server(config, Path(tmp))
        try:
            runs = _served_runs(config, base, workload, vocab)
        finally:
            proc.terminate()
            proc.wait(60)
    print(format_serve_table(offline.output_tok_per_s, runs, bench), flush=True)
    write_serve_results(config, out_dir, offline, runs)
    return runs
