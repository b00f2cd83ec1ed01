"""`mrv2 bench experiment=serve_nano`: the bench's requests through the HTTP API, against offline on the same run.

First the workload runs offline (`LLM.generate`, as `mrv2 bench` does); then the same process starts `mrv2 serve`
on the same config in a child process and sends the same requests as streaming completions (token-id prompts,
`ignore_eos`), all at once and then at each Poisson rate of `bench.request_rates`. Reported per run: output
tok/s, and TTFT, TPOT (per request) and inter-token latency (per chunk gap) p50 / p90 / p99.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from framework.config.schema import Mrv2Config
from framework.entrypoints.bench.throughput import Workload, bench_mrv2, make_workload, result_dict
from framework.entrypoints.llm import LLM

_COMPLETION_TOKENS = re.compile(rb'"usage": \{[^}]*"completion_tokens": (\d+)')


@dataclass(frozen=True)
class ServedRun:
    """One pass of the workload through the server."""

    rate: float  # requests per second (inf: all at once)
    seconds: float
    output_tokens: int
    ttft_s: tuple[float, float, float]  # p50, p90, p99
    tpot_s: tuple[float, float, float]
    itl_s: tuple[float, float, float]

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (math.nan, math.nan, math.nan)
    values = sorted(values)
    return tuple(values[min(len(values) - 1, int(q * len(values)))] for q in (0.5, 0.9, 0.99))  # type: ignore


async def _one(
    host: str, port: int, prompt: list[int], max_tokens: int, temperature: float, seed: int, delay: float
) -> tuple[float, list[float], int]:
    """Stream one completion after `delay` s over its own connection; (start, arrival time of each HTTP chunk,
    completion tokens from the usage frame). A bare HTTP/1.1 client: per chunk it only reads bytes, so the
    measuring client is not what limits a fast server."""
    await asyncio.sleep(delay)
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(body)) + body
    )
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"the server answered {status!r}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers (the body is chunked)
    times, tokens = [], 0
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            break
        data = await reader.readexactly(size + 2)
        usage = _COMPLETION_TOKENS.search(data)
        if usage is not None:  # the usage frame (no tokens)
            tokens = int(usage.group(1))
        elif not data.startswith(b"data: [DONE]"):
            times.append(time.perf_counter())
    writer.close()
    return start, times, tokens


async def _served_run(base: str, workload: Workload, temperature: float, seed: int, rate: float) -> ServedRun:
    from urllib.parse import urlsplit

    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in workload.prompts:
        delays.append(t)
        t += rng.expovariate(rate) if math.isfinite(rate) else 0.0
    url = urlsplit(base)
    begin = time.perf_counter()
    results = await asyncio.gather(
        *[
            _one(url.hostname or "127.0.0.1", url.port or 80, p, n, temperature, seed + i, d)
            for i, (p, n, d) in enumerate(zip(workload.prompts, workload.output_lens, delays))
        ]
    )
    end = time.perf_counter()
    ttft, tpot, itl = [], [], []
    for start, times, tokens in results:
        if times:
            ttft.append(times[0] - start)
            if tokens > 1:
                tpot.append((times[-1] - times[0]) / (tokens - 1))
            itl.extend(b - a for a, b in zip(times, times[1:]))
    return ServedRun(rate, end - begin, sum(r[2] for r in results), _quantiles(ttft), _quantiles(tpot), _quantiles(itl))


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


def format_serve_table(offline_tok_s: float, runs: list[ServedRun]) -> str:
    rows = [
        "| run | output tok/s | vs offline | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms |",
        "|---|---:|---:|---|---|---|",
        f"| offline LLM.generate | {offline_tok_s:,.0f} | 1.00 | | | |",
    ]
    for r in runs:
        name = "served, all at once" if not math.isfinite(r.rate) else f"served, {r.rate:g} req/s"
        ms = lambda q: "/".join(f"{1000 * v:.1f}" for v in q)  # noqa: E731
        rows.append(
            f"| {name} | {r.output_tok_per_s:,.0f} | {r.output_tok_per_s / offline_tok_s:.2f} | "
            f"{ms(r.ttft_s)} | {ms(r.tpot_s)} | {ms(r.itl_s)} |"
        )
    return "\n".join(rows)


def run_serve_bench(config: Mrv2Config, out_dir: Path) -> list[ServedRun]:
    """Offline, then served (all at once, then each `bench.request_rates`); table, bench.json, bench.png."""
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
    runs: list[ServedRun] = []
    with tempfile.TemporaryDirectory(prefix="mrv2-bench-serve-") as tmp:
        proc, base = _start_server(config, Path(tmp))
        try:
            warm = make_workload(
                bench.model_copy(
                    update={
                        "num_requests": max(bench.warmup_requests, 1),
                        "seed": bench.seed + 1,
                        "output_len": (8, 16),
                    }
                ),
                vocab,
            )
            _run_async(_served_run(base, warm, bench.temperature, bench.seed, math.inf))
            for rate in [math.inf, *bench.request_rates]:
                run = _run_async(_served_run(base, workload, bench.temperature, bench.seed, rate))
                runs.append(run)
                print(f"served (rate {run.rate:g}): {run.output_tok_per_s:,.0f} output tok/s", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(60)
    table = format_serve_table(offline.output_tok_per_s, runs)
    print(table, flush=True)
    _write(config, out_dir, offline, runs)
    return runs


def _write(config: Mrv2Config, out_dir: Path, offline, runs: list[ServedRun]) -> None:  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config.model_dump(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "offline": result_dict(offline),
        "served": [
            asdict(r)
            | {"output_tok_per_s": r.output_tok_per_s, "vs_offline": r.output_tok_per_s / offline.output_tok_per_s}
            for r in runs
        ],
    }
    (out_dir / "bench.json").write_text(json.dumps(payload, indent=2, default=str))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = ["offline"] + ["served (all)" if not math.isfinite(r.rate) else f"served {r.rate:g}/s" for r in runs]
    ax.bar(names, [offline.output_tok_per_s] + [r.output_tok_per_s for r in runs])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"mrv2 serve bench '{config.bench.name}' ({config.bench.num_requests} requests)")
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=120)
    plt.close(fig)
    print(f"results written to {out_dir}", file=sys.stderr)
