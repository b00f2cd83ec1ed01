"""What `mrv2 bench` writes next to Hydra's run directory: bench.json and bench.png.

The plot answers what a reader of a throughput bench asks: how fast each engine was on the same requests
(output tokens/s, mrv2 beside its baselines, each bar labelled with its number), and how long requests waited
(the distribution of per-request time to first token, one curve per mrv2 run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from framework.config.schema import Mrv2Config

if TYPE_CHECKING:
    from framework.entrypoints.bench.throughput import BenchResult


def write_results(
    results: list["BenchResult"], config: Mrv2Config, out_dir: Path, extra: Optional[dict] = None
) -> None:
    """bench.json (config + results) and bench.png (throughput against the baselines, TTFT distribution)."""
    from framework.entrypoints.bench.throughput import result_dict

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config.model_dump(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "results": [result_dict(r) for r in results],
        **(extra or {}),
    }
    (out_dir / "bench.json").write_text(json.dumps(payload, indent=2))
    plot_results(results, f"mrv2 bench '{config.bench.name}' ({config.bench.num_requests} requests)").savefig(
        out_dir / "bench.png", dpi=120
    )


def plot_results(results: list["BenchResult"], title: str) -> Any:
    """The figure (matplotlib, Agg): throughput bars per engine; per-request TTFT as an empirical CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_ttft = [r for r in results if r.ttft_s]
    fig, axes = plt.subplots(1, 2 if with_ttft else 1, figsize=(11 if with_ttft else 6, 4), squeeze=False)
    bars = axes[0][0]
    names = [r.engine for r in results]
    rates = [r.output_tok_per_s for r in results]
    drawn = bars.bar(names, rates, color=["tab:blue" if n.startswith("mrv2") else "tab:gray" for n in names])
    bars.bar_label(drawn, labels=[f"{v:,.0f}" for v in rates], padding=2)
    bars.margins(y=0.15)  # room for the labels
    bars.set_ylabel("output tokens / s (same requests)")
    bars.set_title("throughput against the baselines" if len(results) > 1 else "throughput")
    bars.tick_params(axis="x", labelrotation=15)
    if with_ttft:
        cdf = axes[0][1]
        for r in with_ttft:
            ttft_ms = [t * 1000 for t in r.ttft_s or []]
            share = [(i + 1) / len(ttft_ms) for i in range(len(ttft_ms))]
            cdf.step(ttft_ms, share, where="post", label=f"{r.engine} (p50 {ttft_ms[len(ttft_ms) // 2]:,.0f} ms)")
        cdf.set_xlabel("time to first token per request (ms; all requests arrive at once)")
        cdf.set_ylabel("share of requests")
        cdf.set_ylim(0, 1.02)
        cdf.set_xlim(left=0)
        cdf.set_title("per-request latency distribution")
        cdf.legend(loc="lower right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    plt.close(fig)
    return fig
