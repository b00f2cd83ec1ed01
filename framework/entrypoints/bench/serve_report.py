"""The serving benchmark's numbers per run, its table, its JSON and its plot.

What a user feels, per run: time to first token and time per output token (per request), the gap between
consecutive events of one stream (a reader sees it as a pause) and how many tokens an event carries (a reader
sees more than one as a jump), and goodput: the requests per second that met both the TTFT and TPOT targets.
The plot is the curve serving papers draw: throughput per user (1 / TPOT p50) against throughput per GPU.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from framework.config.schema import BenchConfig, Mrv2Config
from framework.entrypoints.bench.stream_client import StreamRecord
from framework.entrypoints.bench.throughput import result_dict

Quantiles = tuple[float, float, float]  # p50, p90, p99


@dataclass(frozen=True)
class ServedRun:
    """One pass of (part of) the workload through the server."""

    label: str
    rate: float  # requests per second (inf: all at once; nan: closed loop)
    concurrency: Optional[int]  # users of a closed-loop run
    num_requests: int
    seconds: float
    output_tokens: int
    ttft_s: Quantiles
    tpot_s: Quantiles
    gap_s: Quantiles  # between consecutive events of a stream
    tokens_per_event: float
    tokens_per_http_chunk: float
    goodput_req_s: float  # requests per second that met both targets
    slo_fraction: float  # share of requests that met both targets

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def per_user_tok_s(self) -> float:
        """What one user's stream runs at: 1 / TPOT p50."""
        return 1.0 / self.tpot_s[0] if self.tpot_s[0] > 0 else math.nan

    @property
    def itl_s(self) -> Quantiles:
        return self.gap_s


def quantiles(values: list[float]) -> Quantiles:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return (math.nan, math.nan, math.nan)
    return tuple(values[min(len(values) - 1, int(q * len(values)))] for q in (0.5, 0.9, 0.99))  # type: ignore


def summarize(
    label: str,
    records: list[StreamRecord],
    seconds: float,
    bench: BenchConfig,
    rate: float = math.nan,
    concurrency: Optional[int] = None,
) -> ServedRun:
    """One run's numbers from its streams as the clients saw them."""
    tokens = sum(r.completion_tokens for r in records)
    events = sum(len(r.event_times) for r in records)
    chunks = sum(r.num_http_chunks for r in records)
    good = sum(
        1
        for r in records
        if r.ttft_s * 1000 <= bench.slo_ttft_ms and (math.isnan(r.tpot_s) or r.tpot_s * 1000 <= bench.slo_tpot_ms)
    )
    return ServedRun(
        label,
        rate,
        concurrency,
        len(records),
        seconds,
        tokens,
        quantiles([r.ttft_s for r in records]),
        quantiles([r.tpot_s for r in records]),
        quantiles([g for r in records for g in r.gaps_s]),
        tokens / max(events, 1),
        tokens / max(chunks, 1),
        good / seconds,
        good / max(len(records), 1),
    )


def format_serve_table(offline_tok_s: float, runs: list[ServedRun], bench: BenchConfig) -> str:
    """Markdown: one row per run, offline first."""
    ms = lambda q: "/".join(f"{1000 * v:.1f}" for v in q)  # noqa: E731
    rows = [
        "| run | output tok/s | vs offline | per user tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
        "| gap p50/p90/p99 ms | tokens / event | tokens / HTTP chunk "
        f"| goodput req/s (TTFT <= {bench.slo_ttft_ms:g} ms, TPOT <= {bench.slo_tpot_ms:g} ms) |",
        "|---|---:|---:|---:|---|---|---|---:|---:|---:|",
        f"| offline LLM.generate | {offline_tok_s:,.0f} | 1.00 | | | | | | | |",
    ]
    for r in runs:
        rows.append(
            f"| served, {r.label} | {r.output_tok_per_s:,.0f} | {r.output_tok_per_s / offline_tok_s:.2f} "
            f"| {r.per_user_tok_s:,.0f} | {ms(r.ttft_s)} | {ms(r.tpot_s)} | {ms(r.gap_s)} | {r.tokens_per_event:.2f} "
            f"| {r.tokens_per_http_chunk:.2f} | {r.goodput_req_s:.2f} ({100 * r.slo_fraction:.0f}%) |"
        )
    return "\n".join(rows)


def _run_dict(run: ServedRun, offline_tok_s: float) -> dict[str, Any]:
    return asdict(run) | {
        "output_tok_per_s": run.output_tok_per_s,
        "vs_offline": run.output_tok_per_s / offline_tok_s,
        "per_user_tok_s": run.per_user_tok_s,
    }


def write_serve_results(config: Mrv2Config, out_dir: Path, offline: Any, runs: list[ServedRun]) -> None:
    """bench.json (config, device, offline, every run) and bench.png (per user against per GPU; tok/s per run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config.model_dump(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "offline": result_dict(offline),
        "served": [_run_dict(r, offline.output_tok_per_s) for r in runs],
    }
    (out_dir / "bench.json").write_text(json.dumps(payload, indent=2, default=str))
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(11, 4))
    loop = [r for r in runs if r.concurrency is not None]
    curve.plot([r.output_tok_per_s for r in loop], [r.per_user_tok_s for r in loop], "o-", label="closed loop")
    for r in loop:
        curve.annotate(f"{r.concurrency}", (r.output_tok_per_s, r.per_user_tok_s))
    others = [r for r in runs if r.concurrency is None]
    curve.plot([r.output_tok_per_s for r in others], [r.per_user_tok_s for r in others], "s", label="open loop")
    curve.set_xlabel("output tokens / s per GPU")
    curve.set_ylabel("output tokens / s per user (1 / TPOT p50)")
    curve.set_title("throughput per user against per GPU")
    curve.legend()
    names = ["offline"] + [r.label for r in runs]
    bars.bar(names, [offline.output_tok_per_s] + [r.output_tok_per_s for r in runs])
    bars.set_ylabel("output tokens / s")
    bars.tick_params(axis="x", labelrotation=45)
    bars.set_title(f"'{config.bench.name}' ({config.bench.num_requests} requests)")
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=120)
    plt.close(fig)
    print(f"results written to {out_dir}", file=sys.stderr)
