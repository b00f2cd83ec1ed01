"""Benchmark structured outputs: step time with half the batch JSON-schema constrained against none.

The "nano" workload (256 requests, input and output lengths uniform in [100, 1024], random prompt ids,
ignore_eos, temperature 0.6, Qwen3-0.6B geometry with random weights) runs twice per round on one engine:
`free` (no request constrained) and `half` (every other request constrained by `SCHEMA`, an array of
records with `minItems` too large to close within 1024 tokens, so both runs have the same lengths and batch
shapes). Reported per run: wall seconds, engine steps, mean step time (wall / steps), median step interval,
output tok/s; for `half` also where the grammar's host time goes: per step (p50) the mask fill (start to last
row, on the fill threads), the part of it the main thread waited for in the sampler (`exposed`: the fill's cost
to the step; the rest was hidden behind queueing the logits and the sampler), the main thread's time starting
the fill (`prepare`: draft checks, the job list) and advancing the matchers over the last step's tokens, and
how many constrained outputs the grammar refuses (must be 0). The overhead is (half - free) / free of the mean
step time, per round; the goal is <= 10 %.

The presets use the byte tokenizer (257 live tokens of the 151,936). So the script also runs
`bench_structured_fill` (128 masks per step, no model): llguidance's own parallel fill against mrv2's fill
threads on that vocabulary and on a synthetic 151,936-token one (the 256 bytes plus random printable strings),
where masks inside strings cost far more, as with a real tokenizer.

    PYTHONPATH=$PWD python3 benchmarks/bench_structured.py --out OUT_DIR [--rounds 2] [--quick] [--fill-threads N ...]

`--quick` runs a CPU-sized version on random_tiny (the smoke test). Prints a table; writes
`structured_bench.json` and, with matplotlib, `structured_bench.png` into OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, also when not installed

import bench_structured_fill  # noqa: E402  (this script's folder is on sys.path)
from bench_structured_fill import SCHEMA  # noqa: E402  (shared with the fill bench)

from framework import SamplingParams, StructuredOutputsParams  # noqa: E402
from framework.config.schema import load_config  # noqa: E402
from framework.entrypoints.llm import LLM  # noqa: E402
from samplers.structured.state import StructuredOutputsState  # noqa: E402


def _engine(quick: bool) -> LLM:
    data: dict[str, Any] = {
        "model": {"preset": "random_tiny" if quick else "qwen3-0.6b", "max_model_len": 256 if quick else 2048},
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 1024 if quick else 8192},
        "device": "cpu" if quick else "cuda",
        "seed": 0,
    }
    return LLM(config=load_config(data))


def _workload(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    vocab = 256 if vocab <= 512 else vocab  # byte presets: prompts in bytes
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]
    return prompts, [rng.randint(*lengths) for _ in range(n)]


class _Timers:
    """Host seconds inside the grammar state's `prepare` and `advance`, the fill timings, and step start times."""

    def __init__(self, llm: LLM) -> None:
        self.prepare = self.advance = 0.0
        self.step_starts: list[float] = []
        self.state: StructuredOutputsState = llm.engine.runner.sampling_states.structured
        self.state.fill_timings = []
        engine = llm.engine
        for name in ("prepare", "advance"):
            setattr(self.state, name, self._timed(getattr(self.state, name), name))
        step = engine.step

        def timed_step():  # type: ignore[no-untyped-def]
            self.step_starts.append(time.perf_counter())
            return step()

        engine.step = timed_step

    def _timed(self, fn, field: str):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)

        return wrapper

    def reset(self) -> None:
        self.prepare = self.advance = 0.0
        self.step_starts = []
        self.state.fill_timings = []

    def fill_p50_ms(self) -> tuple[float, float]:
        """(fill, exposed) p50 over the steps that filled masks, ms; zeros when none did."""
        timings = self.state.fill_timings or []
        if not timings:
            return 0.0, 0.0
        return (
            1e3 * statistics.median(t.fill_s for t in timings),
            1e3 * statistics.median(t.exposed_s for t in timings),
        )


def _run(
    llm: LLM, timers: _Timers, prompts: list[list[int]], lens: list[int], constrained: bool, temperature: float
) -> dict[str, Any]:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=n,
            ignore_eos=True,
            seed=i,
            structured_outputs=so if constrained and i % 2 == 0 else None,
        )
        for i, n in enumerate(lens)
    ]
    state: StructuredOutputsState = llm.engine.runner.sampling_states.structured
    refused_before = state.num_refused
    llm.reset_prefix_cache()  # every run starts cold: the same prompts run four times
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timers.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    steps = len(timers.step_starts)
    intervals = [b - a for a, b in zip(timers.step_starts, timers.step_starts[1:])]
    out_tokens = sum(len(o.token_ids) for o in outs)
    fill_p50, exposed_p50 = timers.fill_p50_ms()
    short = sum(len(o.token_ids) != n for o, n in zip(outs, lens))
    return {
        "run": "half" if constrained else "free",
        "seconds": seconds,
        "steps": steps,
        "mean_step_ms": 1e3 * seconds / max(steps, 1),
        "median_step_ms": 1e3 * statistics.median(intervals) if intervals else 0.0,
        "output_tok_per_s": out_tokens / seconds,
        "output_tokens": out_tokens,
        "fill_p50_ms": fill_p50,
        "fill_exposed_p50_ms": exposed_p50,
        "fill_hidden_fraction": 1 - exposed_p50 / fill_p50 if fill_p50 else 0.0,
        "fill_steps": len(timers.state.fill_timings or []),
        # the filler's running CPU cost per mask at the end, and whether it was handing steps to its workers
        "mask_cost_us": 1e6 * (state._filler.mask_cost_s or 0.0) if state._filler is not None else 0.0,
        "fill_on_workers": bool(state._filler is not None and state._filler.uses_workers),
        "prepare_ms_per_step": 1e3 * timers.prepare / max(steps, 1),
        "advance_ms_per_step": 1e3 * timers.advance / max(steps, 1),
        "refused_tokens": state.num_refused - refused_before,
        "outputs_short_of_max_tokens": short,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run on random_tiny")
    ap.add_argument(
        "--fill-threads",
        type=int,
        nargs="+",
        default=None,
        help="sampler.structured_outputs_fill_threads of each constrained run of a round (default: "
        "min(8, CPUs), 2 and 0; --quick: 2 and 0)",
    )
    args = ap.parse_args(argv)
    quick = args.quick
    llm = _engine(quick)
    state: StructuredOutputsState = llm.engine.runner.sampling_states.structured
    thread_counts = args.fill_threads or ([2, 0] if quick else [state.fill_threads, 2, 0])
    vocab = llm.engine.loaded.vocab_size
    n = 8 if quick else 256
    lengths = (4, 12) if quick else (100, 1024)
    timers = _Timers(llm)
    warm_prompts, warm_lens = _workload(min(n, 32), (min(lengths[0], 16), min(lengths[1], 16)), vocab, seed=1)
    _run(llm, timers, warm_prompts, warm_lens, True, 0.6)  # compiles the grammar, builds the vocabulary
    prompts, lens = _workload(n, lengths, vocab, seed=0)
    runs = []
    for r in range(args.rounds):
        for threads in [None] + thread_counts:  # None: the unconstrained run
            if threads is not None:
                state.set_fill_threads(threads)
            result = _run(llm, timers, prompts, lens, threads is not None, 0.6)
            result.update(round=r, fill_threads=threads)
            runs.append(result)
            print(
                f"round {r} {result['run']:>4} (fill threads {threads}): {result['seconds']:.2f} s, "
                f"{result['steps']} steps, {result['mean_step_ms']:.2f} ms/step",
                file=sys.stderr,
            )
    free = {x["round"]: x["mean_step_ms"] for x in runs if x["run"] == "free"}
    for x in runs:
        x["overhead"] = (x["mean_step_ms"] - free[x["round"]]) / free[x["round"]] if x["run"] == "half" else 0.0
    overheads = [x["overhead"] for x in runs if x["run"] == "half" and x["fill_threads"] == thread_counts[0]]
    fill = (
        bench_structured_fill.run(["nano"], [0, 2], steps=10)
        if quick
        else bench_structured_fill.run(["nano", "synthetic"], [0, 1, 2, 4, 8])
    )
    report = {
        "workload": {
            "requests": n,
            "lengths": lengths,
            "constrained": "every other request",
            "schema": SCHEMA,
            "device": str(llm.engine.loaded.device),
            "fill_threads": thread_counts,
        },
        "runs": runs,
        "overhead_per_round": overheads,
        "overhead_median": statistics.median(overheads),
        "fill_without_model": fill,
    }
    print(
        "| round | run | fill threads | s | steps | ms/step (mean) | ms/step (median) | out tok/s | fill p50 ms "
        "| exposed p50 ms | prepare ms/step | advance ms/step | refused | overhead |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in runs:
        threads = "" if x["fill_threads"] is None else x["fill_threads"]
        print(
            f"| {x['round']} | {x['run']} | {threads} | {x['seconds']:.2f} | {x['steps']} | {x['mean_step_ms']:.2f} | "
            f"{x['median_step_ms']:.2f} | {x['output_tok_per_s']:.0f} | {x['fill_p50_ms']:.3f} | "
            f"{x['fill_exposed_p50_ms']:.3f} | {x['prepare_ms_per_step']:.3f} | {x['advance_ms_per_step']:.3f} | "
            f"{x['refused_tokens']} | {100 * x['overhead']:+.1f}% |"
        )
    print(
        f"step time overhead per round: {', '.join(f'{100 * o:+.1f}%' for o in overheads)} "
        f"(fill threads {thread_counts[0]}; the table has the others)"
    )
    print("grammar bitmask fill without a model, 128 masks per step (host ms):")
    bench_structured_fill.print_table(fill)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_bench.json").write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
        ax.bar(
            [
                f"r{x['round']} {x['run']}" + ("" if x["fill_threads"] is None else f" t{x['fill_threads']}")
                for x in runs
            ],
            [x["mean_step_ms"] for x in runs],
            color=["tab:blue" if x["run"] == "free" else "tab:orange" for x in runs],
        )
        ax.set_ylabel("mean step time (ms)")
        ax.set_title("nano, half JSON-schema constrained (t = fill threads) vs none")
        ax.tick_params(axis="x", rotation=30)
        nano = [r for r in fill if r["vocab"] == "nano"]
        ax2.bar(
            [r["method"].replace("llguidance ", "").replace("filler, ", "") for r in nano],
            [r["p50_ms"] for r in nano],
            color="tab:green",
        )
        ax2.set_ylabel("host ms per step (p50)")
        ax2.set_title("128 masks per step, nano vocabulary, no model")
        ax2.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(args.out / "structured_bench.png", dpi=120)
    except ImportError:
        pass
    return report


if __name__ == "__main__":
    main()
