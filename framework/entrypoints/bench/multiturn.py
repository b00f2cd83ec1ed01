"""`mrv2 bench experiment=multiturn`: multi-turn conversations whose context the device KV pool cannot keep,
without and with the host-memory KV tier.

`bench.num_requests` conversations each start from their own random context of `bench.context_len` tokens. Turn
`t` of every conversation arrives at once: its prompt is the conversation so far (context, earlier user tokens
and outputs) plus `bench.input_len` new user tokens; it generates `bench.output_len` tokens (seeded sampling,
ignore_eos). The device pool (`cache.num_blocks`) is sized to hold `bench.kv_pool_fraction` of the conversations
at their longest, so a conversation's blocks are evicted before its next turn: without the tier the later turns
recompute their whole prefix, with it they load it from host memory. The workload runs on two fresh engines,
`cache.host_kv_gib` 0 then `bench.host_kv_gib`, and reports TTFT p50 of the later turns (2..), TTFT per turn,
total throughput and the tier's counters; a table on stdout, `multiturn.json` and `multiturn.png` in the output
directory.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from framework.config.schema import BenchConfig, Mrv2Config
from framework.engine.request import RequestOutput
from framework.entrypoints.bench.throughput import ttft_summary, warm_up
from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams


@dataclass
class MultiturnResult:
    """One engine's run of every turn."""

    engine: str
    host_kv_gib: float
    num_blocks: int
    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    ttft_p50_later_s: Optional[float] = None  # turns 2.. together
    ttft_p90_later_s: Optional[float] = None
    ttft_p50_by_turn_s: list[Optional[float]] = field(default_factory=list)
    prefix_cache_hits: int = 0  # prompt tokens served from the device cache
    tier: dict[str, Any] = field(default_factory=dict)  # the host tier's counters (KVTierStats)
    tokens: list[list[int]] = field(default_factory=list, repr=False)  # every turn's outputs, not written

    @property
    def total_tok_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds if self.seconds else 0.0


def device_pool_blocks(config: Mrv2Config) -> int:
    """Blocks for `bench.kv_pool_fraction` of the conversations at their longest (at least one full request)."""
    bench, block_size = config.bench, config.cache.block_size
    longest = bench.context_len + bench.num_turns * (bench.input_len[1] + bench.output_len[1])
    wanted = int(bench.kv_pool_fraction * bench.num_requests * longest)
    return max(-(-wanted // block_size), -(-(config.model.max_model_len or longest) // block_size))


def _turn_lengths(bench: BenchConfig, rng: random.Random, vocab: int) -> tuple[list[int], int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(*bench.input_len))], rng.randint(*bench.output_len)


def run_turns(llm: LLM, bench: BenchConfig, result: MultiturnResult) -> None:
    """Every conversation's turns, turn by turn, into `result`."""
    vocab_size = llm.engine.loaded.vocab_size
    vocab = min(vocab_size, 256) if vocab_size <= 512 else vocab_size  # byte-level presets: stay in bytes
    rng = random.Random(bench.seed)
    history = [[rng.randrange(vocab) for _ in range(bench.context_len)] for _ in range(bench.num_requests)]
    later: list[RequestOutput] = []
    for turn in range(bench.num_turns):
        turns = [_turn_lengths(bench, rng, vocab) for _ in history]
        prompts = [h + user for h, (user, _) in zip(history, turns)]
        params = [
            SamplingParams(
                temperature=bench.temperature, max_tokens=n, ignore_eos=True, seed=bench.seed + 1000 * turn + i
            )
            for i, (_, n) in enumerate(turns)
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if llm.engine.loaded.device.type == "cuda":
            torch.cuda.synchronize()
        result.seconds += time.perf_counter() - start
        result.input_tokens += sum(len(p) for p in prompts)
        result.output_tokens += sum(len(o.token_ids) for o in outputs)
        result.ttft_p50_by_turn_s.append(ttft_summary(outputs).get("ttft_p50_s"))
        result.tokens.extend(o.token_ids for o in outputs)
        if turn:
            later.extend(outputs)
        history = [p + o.token_ids for p, o in zip(prompts, outputs)]
        print(f"{result.engine}: turn {turn + 1}/{bench.num_turns} done", file=sys.stderr)
    summary = ttft_summary(later)
    result.ttft_p50_later_s, result.ttft_p90_later_s = summary.get("ttft_p50_s"), summary.get("ttft_p90_s")


def run_multiturn_bench(config: Mrv2Config, out_dir: Path) -> list[MultiturnResult]:
    """The multi-turn workload without, then with, the host tier; prints the table, writes JSON and plot."""
    num_blocks = device_pool_blocks(config)
    results = []
    for gib in (0.0, config.bench.host_kv_gib):
        cache = config.cache.model_copy(update={"host_kv_gib": gib, "num_blocks": num_blocks})
        llm = LLM(config=config.model_copy(update={"cache": cache}))
        result = MultiturnResult("host tier on" if gib else "host tier off", gib, num_blocks)
        warm_up(llm, config.bench)  # also empties the host tier
        hits_before = llm.prefix_cache_stats.hits
        run_turns(llm, config.bench, result)
        result.prefix_cache_hits = llm.prefix_cache_stats.hits - hits_before
        result.tier = dataclasses.asdict(llm.engine.kv_tier_stats)
        results.append(result)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(format_multiturn_table(results))
    off, on = results
    if off.ttft_p50_later_s and on.ttft_p50_later_s and off.seconds and on.seconds:
        print(
            f"host tier off/on: TTFT p50 of turns 2..{config.bench.num_turns} "
            f"{off.ttft_p50_later_s / on.ttft_p50_later_s:.2f}x; on/off: total throughput "
            f"{on.total_tok_per_s / off.total_tok_per_s:.2f}x"
        )
    _write(results, config, out_dir)
    print(f"results written to {out_dir}", file=sys.stderr)
    return results


def format_multiturn_table(results: list[MultiturnResult]) -> str:
    rows = [
        f"{'engine':<15} {'GiB':>6} {'blocks':>7} {'TTFT p50 t2+ ms':>16} {'TTFT p90 t2+ ms':>16} "
        f"{'total tok/s':>12} {'host hit tok':>13} {'failed':>7}"
    ]
    for r in results:
        p50 = f"{r.ttft_p50_later_s * 1e3:.1f}" if r.ttft_p50_later_s is not None else "-"
        p90 = f"{r.ttft_p90_later_s * 1e3:.1f}" if r.ttft_p90_later_s is not None else "-"
        rows.append(
            f"{r.engine:<15} {r.host_kv_gib:>6g} {r.num_blocks:>7} {p50:>16} {p90:>16} {r.total_tok_per_s:>12.1f} "
            f"{r.tier.get('hit_tokens', 0):>13} {r.tier.get('failed_loads', 0):>7}"
        )
    return "\n".join(rows)


def _write(results: list[MultiturnResult], config: Mrv2Config, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config.model_dump(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "results": [
            {k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"} | {"total_tok_per_s": r.total_tok_per_s}
            for r in results
        ],
    }
    (out_dir / "multiturn.json").write_text(json.dumps(payload, indent=2))
    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(9, 3.5))
    for r in results:
        turns = range(1, len(r.ttft_p50_by_turn_s) + 1)
        ax_ttft.plot(turns, [(t or 0.0) * 1e3 for t in r.ttft_p50_by_turn_s], marker="o", label=r.engine)
    ax_ttft.set_xlabel("turn")
    ax_ttft.set_ylabel("TTFT p50 (ms)")
    ax_ttft.legend()
    ax_tput.bar([r.engine for r in results], [r.total_tok_per_s for r in results])
    ax_tput.set_ylabel("total tokens / s")
    bench = config.bench
    fig.suptitle(
        f"{bench.num_requests} conversations x {bench.num_turns} turns over {bench.context_len}-token contexts"
    )
    fig.tight_layout()
    fig.savefig(out_dir / "multiturn.png", dpi=120)
    plt.close(fig)
