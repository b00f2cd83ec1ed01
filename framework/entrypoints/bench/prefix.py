"""`mrv2 bench experiment=prefix_bench`: a shared system prompt, with and without prefix caching.

Every request is one random "system prompt" of `bench.shared_prefix_len` tokens followed by a unique random
suffix (length uniform in `bench.input_len`); output lengths are uniform in `bench.output_len`. The workload
runs twice on fresh engines of the same config, `cache.enable_prefix_caching` false then true, each after a
short warm-up whose cached blocks are dropped. All requests arrive at once, so time to first token (TTFT)
includes queueing behind earlier prefills. Prints a table on stdout, writes `prefix_bench.json` and
`prefix_bench.png` into the output directory.
"""

from __future__ import annotations

import gc
import json
import random
import sys
from pathlib import Path

import torch

from framework.config.schema import BenchConfig, Mrv2Config
from framework.entrypoints.bench.throughput import (
    BenchResult,
    Workload,
    bench_mrv2,
    format_table,
    graphs_expected,
    result_dict,
)
from framework.entrypoints.llm import LLM


def make_prefix_workload(bench: BenchConfig, vocab_size: int) -> Workload:
    """One shared random prefix, then a unique random suffix per request; all from `bench.seed`."""
    rng = random.Random(bench.seed)
    vocab = min(vocab_size, 256) if vocab_size <= 512 else vocab_size  # byte-level presets: stay in bytes
    shared = [rng.randrange(vocab) for _ in range(bench.shared_prefix_len)]
    prompts, outs = [], []
    for _ in range(bench.num_requests):
        prompts.append(shared + [rng.randrange(vocab) for _ in range(rng.randint(*bench.input_len))])
        outs.append(rng.randint(*bench.output_len))
    return Workload(prompts, outs)


def run_prefix_bench(config: Mrv2Config, out_dir: Path) -> list[BenchResult]:
    """Run the shared-prefix workload without and with prefix caching; print the table; write JSON and plot."""
    results = []
    workload = None
    on_gpu = False
    for enabled in (False, True):
        cache = config.cache.model_copy(update={"enable_prefix_caching": enabled})
        llm = LLM(config=config.model_copy(update={"cache": cache}))
        on_gpu = llm.engine.loaded.device.type == "cuda"
        workload = workload or make_prefix_workload(config.bench, llm.engine.loaded.vocab_size)
        results.append(bench_mrv2(llm, workload, config.bench))
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(format_table(results))
    if graphs_expected(config, on_gpu):
        print(
            "forwards run eagerly during the timed runs (no decode graph): "
            + ", ".join(f"{r.engine} {r.eager_forwards}" for r in results)
        )
    off, on = results
    if off.ttft_p50_s and on.ttft_p50_s:
        print(
            f"prefix caching off/on: TTFT p50 {off.ttft_p50_s / on.ttft_p50_s:.2f}x; "
            f"on/off: total throughput {on.total_tok_per_s / off.total_tok_per_s:.2f}x"
        )
    _write(results, config, out_dir)
    print(f"results written to {out_dir}", file=sys.stderr)
    return results


def _write(results: list[BenchResult], config: Mrv2Config, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config.model_dump(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "results": [result_dict(r) | {"prefix_caching": enabled} for r, enabled in zip(results, (False, True))],
    }
    (out_dir / "prefix_bench.json").write_text(json.dumps(payload, indent=2))
    labels = ["prefix caching off", "prefix caching on"]
    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(9, 3.5))
    ttft = {"p50": [r.ttft_p50_s or 0.0 for r in results], "p90": [r.ttft_p90_s or 0.0 for r in results]}
    for offset, (name, values) in zip((-0.2, 0.2), ttft.items()):
        ax_ttft.bar([i + offset for i in range(len(results))], [v * 1e3 for v in values], width=0.4, label=name)
    ax_ttft.set_xticks(range(len(results)), labels)
    ax_ttft.set_ylabel("time to first token (ms)")
    ax_ttft.legend()
    ax_tput.bar(labels, [r.total_tok_per_s for r in results])
    ax_tput.set_ylabel("total tokens / s")
    fig.suptitle(f"{config.bench.num_requests} requests sharing a {config.bench.shared_prefix_len}-token prefix")
    fig.tight_layout()
    fig.savefig(out_dir / "prefix_bench.png", dpi=120)
    plt.close(fig)
