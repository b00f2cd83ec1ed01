"""Speculative decoding benchmark (GPU): ngram at fixed k and dynamic-k against no speculation.

Model: the Qwen3-0.6B geometry with random bf16 weights (the "nano" model). Random weights do not repeat
their prompts the way an editing or summarising workload does, so acceptance is set by the workload:

* `greedy-repeat`: prompts made of one random 16-token segment repeated 8 times, greedy decoding. A
  random-weight model under greedy decoding falls into short cycles, and ngram (prompt lookup over the
  request's own history) predicts them: **high acceptance**. This measures the mechanics (verification
  cost, acceptance bookkeeping, graphs with drafts) at the acceptance a copy-heavy workload would reach; it
  says nothing about how often a trained model repeats itself.
* `sampled`: the same prompts at temperature 1.0. The random model's distribution is close to uniform over
  151,936 tokens, so drafts are almost never accepted: **acceptance ~0**, the case where speculation only
  costs (dynamic-k should pick k = 0).
* `shifting`: 252 `sampled` requests with short outputs plus 4 `greedy-repeat` requests with long outputs,
  submitted together: the batch starts large with acceptance ~0 and ends small with high acceptance. No
  fixed k suits both phases.

For every batch size (1, 16, 64, 256 requests at once) and workload it runs: no speculation (its own
engine), then one ngram engine whose draft-length policy is swapped between fixed k in {0, 1, 2, 3, 5} and a
fresh dynamic-k policy (the engine captures CUDA graphs for every k). It reports output tokens/s, mean
acceptance length, per-position acceptance, and for dynamic-k the k it chose. Dynamic-k's policy starts
fresh for each workload and batch size and learns in one untimed run first (reported as its "cold" run).
Every cell is the median of `--repeats` timed runs; the repeats go round-robin over the policies of a cell
(k = 0, 1, 2, 3, 5, dynamic, then again), so a slow period of the machine hits them all alike. Then up to
`--pairs` more rounds run only the best fixed k and dynamic-k, back to back in alternating order, until
`--fast-pairs` rounds had both runs on a fast host (`host_speed`: the H200 machine's host runs at full or
half speed for seconds at a time). Dynamic-k is compared with the best fixed k round by round over every
round and over the fast-host rounds ("paired", `host_speed.paired_ratio`), and every cell also gets its median
over fast-host runs. The JSON keeps every run's host probes, every step's time, device time and whether it
ran eagerly, and dynamic-k's decision log. Writes `bench_spec.json` and `bench_spec.png` into `--out`;
prints a table. About 3 minutes on one H200 with the defaults, 5 with `--pairs 24 --fast-pairs 8`.

    python benchmarks/bench_spec.py --repeats 3 --pairs 24 --fast-pairs 8 --out bench_results/spec
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_speed import fast_runs, fastest_policy, fastest_probe, host_probe_us, median, paired_ratio  # noqa: E402

BATCH_SIZES = (1, 16, 64, 256)
FIXED_KS = (0, 1, 2, 3, 5)
K_MAX = 5


def build_llm(speculate: bool, max_model_len: int, smoke: bool = False):  # type: ignore[no-untyped-def]
    from framework import LLM
    from framework.config.schema import load_config

    spec = (
        {
            "method": "ngram",
            "dynamic_k": True,
            "num_speculative_tokens": K_MAX,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        }
        if speculate
        else {"method": "none"}
    )
    config = load_config(
        {
            "model": {"preset": "tiny" if smoke else "qwen3-0.6b", "max_model_len": max_model_len},
            "device": "cpu" if smoke else "cuda",
            "scheduler": {"max_num_seqs": max(BATCH_SIZES), "max_num_batched_tokens": 8192},
            "runner": {"cuda_graph_sizes": list(BATCH_SIZES)},
            "speculator": spec,
            "seed": 0,
        }
    )
    return LLM(config=config)


def repeat_prompt(rng: random.Random, vocab: int) -> list[int]:
    segment = [rng.randrange(vocab) for _ in range(16)]
    return segment * 8


def workload(name: str, batch: int, output_len: int, vocab: int, seed: int) -> tuple[list, list]:
    """(prompts, SamplingParams per request) of one run."""
    from framework import SamplingParams

    rng = random.Random(seed)
    prompts = [repeat_prompt(rng, vocab) for _ in range(batch)]
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if name == "greedy-repeat":
        return prompts, [greedy] * batch
    if name == "sampled":
        return prompts, [
            SamplingParams(temperature=1.0, seed=seed + i, max_tokens=output_len, ignore_eos=True) for i in range(batch)
        ]
    assert name == "shifting"
    short = [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=output_len // 4, ignore_eos=True)
        for i in range(batch - 4)
    ]
    long = [SamplingParams(temperature=0.0, max_tokens=output_len * 4, ignore_eos=True)] * 4
    return prompts, short + long


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens/s, with every run's figure in round order (`runs_tok_per_s`). Runs are
    short (0.1-2 s), so one host hiccup (a garbage collection, a page fault) can move one of them."""
    ordered = sorted(runs, key=lambda r: r["output_tok_per_s"])
    best = dict(ordered[len(ordered) // 2])
    best["runs_tok_per_s"] = [round(r["output_tok_per_s"]) for r in runs]
    best["runs_host_probe_us"] = [r["host_probe_us"] for r in runs]
    best["compiles_during_run"] = sorted({c for r in runs for c in r["compiles_during_run"]})
    return best


def run_round_robin(
    llm,
    policies: dict[str, Any],
    prompts: list,
    params: list,  # type: ignore[no-untyped-def]
    repeats: int,
) -> dict[str, list[dict[str, Any]]]:
    """`repeats` rounds, each running the same requests once under every policy in turn (None: the engine's
    own); every run per policy, in round order. Interleaving spreads slow periods of the machine (clocks,
    other tenants, host hiccups) over every policy instead of the one measured at that moment."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    for _ in range(repeats):
        for name, policy in policies.items():
            if policy is not None:
                set_policy(llm, policy)
            runs[name].append(run_once(llm, prompts, params))
    return runs


def run_pairs(
    llm,
    policies: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],  # type: ignore[no-untyped-def]
    prompts: list,
    params: list,
    max_pairs: int,
    fast_pairs: int,
    fastest: float,
    deadline: float = float("inf"),
) -> None:
    """More rounds of two policies only (the best fixed k and dynamic-k: `policies`), back to back and in
    alternating order (A B, B A, ...), appended to `runs`: until `fast_pairs` rounds (counting those in `runs`
    already) had both runs fast-host (`host_speed`), `max_pairs` rounds, or `time.monotonic()` reached
    `deadline`. A comparison of two needs more rounds than a round of six can be repeated, and alternating
    cancels a drift within a round."""
    (a, first), (b, second) = policies.items()
    for i in range(max_pairs):
        if time.monotonic() >= deadline:
            return
        fastest = fastest_probe(runs[a] + runs[b], fastest)
        both = [max(x["host_probe_us"], y["host_probe_us"]) for x, y in zip(runs[a], runs[b])]
        if len(fast_runs(both, both, fastest)) >= fast_pairs:
            return
        for name, policy in ((a, first), (b, second)) if i % 2 == 0 else ((b, second), (a, first)):
            set_policy(llm, policy)
            runs[name].append(run_once(llm, prompts, params))


def pair_deadline(now: float, end: float, cell_seconds: float, cells_left: int) -> float:
    """When the pair rounds of this cell must stop for the run to end by `end` (`--budget-s`): the time left,
    less what the `cells_left` cells after this one need for their fixed rounds (`cell_seconds` each, as this
    cell's took), shared evenly between this cell's pair rounds and theirs."""
    return now + max(0.0, (end - now - cells_left * cell_seconds) / (cells_left + 1))


def run_once(llm, prompts: list, params: list) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    from framework.entrypoints.bench.triton_compiles import compiled_variants, new_variants

    gc.collect()  # garbage of earlier runs is collected now, not in a pause inside this run
    probe_before = host_probe_us()
    engine = llm.engine
    engine.spec_metrics.reset()
    compiled_before = compiled_variants()
    step_ms: list[float] = []
    eager: list[int] = []  # per step: 1 if its forward ran eagerly (no CUDA graph)
    step = engine.step
    runner = engine.runner

    def timed_step():  # type: ignore[no-untyped-def]
        t0, eager0 = time.perf_counter(), getattr(runner, "eager_forwards", 0)
        try:
            return step()
        finally:
            step_ms.append(1e3 * (time.perf_counter() - t0))
            eager.append(getattr(runner, "eager_forwards", 0) - eager0)

    engine.step = timed_step
    if torch.cuda.is_available():
        runner.step_events = []  # device time of each step (execute to the end of sampling and drafting)
    _sync()
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync()
    finally:
        del engine.step
    seconds = time.perf_counter() - start
    probes = [probe_before, host_probe_us()]  # the host's speed around the run (see host_speed)
    events, runner.step_events = runner.step_events or [], None
    device_ms = [_elapsed_ms(a, b) for a, b in events]
    tokens = sum(len(o.token_ids) for o in outs)
    ms = sorted(step_ms)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / seconds,
        "host_probe_us": max(probes),
        "host_probes_us": probes,
        "compiles_during_run": new_variants(compiled_before, compiled_variants()),
        "steps": len(ms),
        "median_step_ms": ms[len(ms) // 2] if ms else 0.0,
        "step_ms": [round(x, 2) for x in step_ms],  # in step order (the JSON keeps them; the table does not)
        "step_eager": eager,
        "step_device_ms": device_ms,
        "eager_steps": sum(eager),
        "slowest_steps_ms": [round(x, 1) for x in ms[-3:]],
        **llm.get_metrics()["spec_decode"],
    }


def _elapsed_ms(start, end) -> Optional[float]:  # type: ignore[no-untyped-def]
    """Device milliseconds between two events; None for a step that recorded no end (nothing to run)."""
    try:
        return round(start.elapsed_time(end), 2)
    except (RuntimeError, ValueError):
        return None


def warm_up(llm, vocab: int, ks: tuple[int, ...], batch_sizes: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Untimed runs at every draft length and batch size the timed runs use: kernels whose sizes follow k
    (ngram proposal, rejection sampler) compile on first use, and a CUDA graph's first replay is slow; both
    would otherwise land in the first timed run of each k (and in dynamic-k's measured costs)."""
    from speculators.policy import FixedK

    for k in ks:
        if ks != (0,):
            set_policy(llm, FixedK(k))
        for name in ("greedy-repeat", "sampled"):
            run_once(llm, *workload(name, 4, 16, vocab, 99))
        for b in batch_sizes:
            run_once(llm, *workload("sampled", b, 4, vocab, 98))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def set_policy(llm, policy) -> None:  # type: ignore[no-untyped-def]
    llm.engine.draft_policy = policy
    llm.engine.scheduler.draft_policy = policy


def pin_cpus(cpus: Optional[str]) -> None:
    """Keep this process (and the threads it starts) on the given CPUs ("2,3" or "2-5"): a host-bound step
    time then does not move with the scheduler migrating the process between cores."""
    if not cpus:
        return
    chosen: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        chosen.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, chosen)
    print(f"pinned to CPUs {sorted(os.sched_getaffinity(0))}", file=sys.stderr)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_results/spec")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is reported")
    parser.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="at most this many more rounds of only the best fixed k and dynamic-k per cell",
    )
    parser.add_argument(
        "--fast-pairs",
        type=int,
        default=8,
        help="... fewer once this many rounds had both runs fast-host (see run_pairs)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="end the pair rounds early so that the whole run takes about this long (a job limit)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--workloads", nargs="+", default=["greedy-repeat", "sampled", "shifting"])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, no figures")
    parser.add_argument("--pin-cpus", default=None, help="run on these CPUs only, e.g. 2,3 (see pin_cpus)")
    args = parser.parse_args(argv)
    end = time.monotonic() + (args.budget_s if args.budget_s is not None else float("inf"))
    pin_cpus(args.pin_cpus)
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("bench_spec.py needs a CUDA device (or --smoke)")
    from speculators.dynamic import DynamicK
    from speculators.policy import FixedK

    max_model_len = min(128 + 4 * args.output_len + 8, 512 if args.smoke else 1 << 20)
    results: list[dict[str, Any]] = []
    plans = [(w, b) for w in args.workloads for b in (args.batch_sizes if w != "shifting" else [max(args.batch_sizes)])]

    def record(engine_name: str, w: str, b: int, r: dict[str, Any], extra: Optional[dict] = None) -> None:
        row = {"workload": w, "batch": b, "engine": engine_name, **r, **(extra or {})}
        results.append(row)
        print(
            f"{w:<14}{b:>6}  {engine_name:<10}{r['output_tok_per_s']:>10.0f} tok/s  "
            f"accept len {r['mean_acceptance_length']:.2f}  {r['steps']} steps, median {r['median_step_ms']:.2f} ms, "
            f"slowest {r['slowest_steps_ms']}, {r['eager_steps']} eager"
            + (f"  compiled during the run: {r['compiles_during_run']}" if r["compiles_during_run"] else ""),
            file=sys.stderr,
        )

    fastest = float("inf")  # the fastest host probe so far (see host_speed)
    llm = build_llm(False, max_model_len, args.smoke)
    vocab = llm.engine.loaded.vocab_size
    warm_up(llm, vocab, (0,), args.batch_sizes)
    for w, b in plans:
        r = run_round_robin(llm, {"none": None}, *workload(w, b, args.output_len, vocab, 1), args.repeats)
        record("none", w, b, median_run(r["none"]))
        fastest = fastest_probe(r["none"], fastest)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    llm = build_llm(True, max_model_len, args.smoke)
    warm_up(llm, vocab, tuple(range(K_MAX + 1)), args.batch_sizes)
    for cell_index, (w, b) in enumerate(plans):
        cell_start = time.monotonic()
        policy = DynamicK(K_MAX, record=True)  # fresh for each cell
        cell = workload(w, b, args.output_len, vocab, 1)
        # Its first run learns (costs, acceptance) from nothing; the timed rounds run it warm, as an engine that
        # has served earlier requests would. The learning run is reported apart ("cold").
        set_policy(llm, policy)
        cold = run_once(llm, *cell)
        policies: dict[str, Any] = {f"ngram k={k}": FixedK(k) for k in FIXED_KS}
        policies["dynamic"] = policy
        runs = run_round_robin(llm, policies, *cell, args.repeats)
        fastest = fastest_probe([r for rs in runs.values() for r in rs], fastest)
        best_k = int(
            fastest_policy(
                {
                    str(k): (
                        [r["output_tok_per_s"] for r in runs[f"ngram k={k}"]],
                        [r["host_probe_us"] for r in runs[f"ngram k={k}"]],
                    )
                    for k in FIXED_KS
                },
                fastest,
            )
        )
        pair = {f"ngram k={best_k}": policies[f"ngram k={best_k}"], "dynamic": policy}
        now = time.monotonic()
        run_pairs(
            llm,
            pair,
            runs,
            *cell,
            args.pairs,
            args.fast_pairs,
            fastest,
            pair_deadline(now, end, now - cell_start, len(plans) - cell_index - 1),
        )
        for k in FIXED_KS:
            record(f"ngram k={k}", w, b, median_run(runs[f"ngram k={k}"]))
        fastest = fastest_probe([r for rs in runs.values() for r in rs], fastest)
        counts = Counter(policy.history)
        record(
            "dynamic",
            w,
            b,
            median_run(runs["dynamic"]),
            {
                "cold_tok_per_s": round(cold["output_tok_per_s"]),
                "best_fixed_k": best_k,
                "k_chosen": dict(sorted(counts.items())),
                "k_history": policy.history,
                "decisions": [d._asdict() for d in policy.decisions or []],
            },
        )
    compare(results, fastest)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    (out / "bench_spec.json").write_text(
        json.dumps({"device": device, "args": vars(args), "results": results}, indent=1)
    )
    print_table(results)
    plot(results, out / "bench_spec.png")
    print(f"results written to {out}", file=sys.stderr)


def compare(results: list[dict[str, Any]], fastest: float) -> None:
    """Add to every row its fast-host median (`fast_host_tok_per_s`, None without a fast-host run) and to
    dynamic-k's rows the round-by-round comparison with the best fixed k (`paired_vs_best`), once the
    fastest probe of the whole benchmark is known."""
    for r in results:
        r["fast_host_tok_per_s"] = median(fast_runs(r["runs_tok_per_s"], r["runs_host_probe_us"], fastest))
    for r in results:
        if r["engine"] == "dynamic":
            best = next(
                x
                for x in results
                if (x["workload"], x["batch"], x["engine"])
                == (r["workload"], r["batch"], f"ngram k={r['best_fixed_k']}")
            )
            r["paired_vs_best"] = paired_ratio(r, best, fastest)


def print_table(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'workload':<14}{'batch':>6}  {'engine':<11}{'out tok/s':>10}{'fast host':>10}{'vs none':>9}"
        f"{'acc len':>9}  per-position acceptance"
    )
    print(head)
    print("-" * len(head))
    base = {(r["workload"], r["batch"]): r["output_tok_per_s"] for r in results if r["engine"] == "none"}
    for r in results:
        rel = r["output_tok_per_s"] / base[(r["workload"], r["batch"])]
        per_pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"])
        fast = f"{r['fast_host_tok_per_s']:>10.0f}" if r["fast_host_tok_per_s"] else f"{'-':>10}"
        chosen = ""
        if "k_chosen" in r:
            p = r["paired_vs_best"]
            fast_paired = (
                f"{100 * (p['fast']['median'] - 1):+.1f}% over {p['fast']['rounds']} fast-host rounds"
                if p["fast"]["rounds"]
                else "no fast-host round"
            )
            chosen = (
                f"  k chosen {r['k_chosen']}; cold run {r['cold_tok_per_s']}; paired vs k={r['best_fixed_k']} "
                f"{100 * (p['median'] - 1):+.1f}% (quartiles "
                f"{', '.join(f'{100 * (q - 1):+.1f}%' for q in p['quartiles'])}; {p['rounds']} rounds), "
                f"{fast_paired}"
            )
        print(
            f"{r['workload']:<14}{r['batch']:>6}  {r['engine']:<11}{r['output_tok_per_s']:>10.0f}{fast}{rel:>8.2f}x"
            f"{r['mean_acceptance_length']:>9.2f}  [{per_pos}]{chosen}"
        )


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in results))
    engines = list(dict.fromkeys(r["engine"] for r in results))
    fig, axes = plt.subplots(1, len(workloads) + 1, figsize=(5 * (len(workloads) + 1), 4))
    for ax, w in zip(axes, workloads):
        rows = [r for r in results if r["workload"] == w]
        batches = sorted({r["batch"] for r in rows})
        width = 0.8 / len(engines)
        for i, e in enumerate(engines):
            ys = [
                next((r["output_tok_per_s"] for r in rows if r["engine"] == e and r["batch"] == b), 0) for b in batches
            ]
            ax.bar([j + i * width for j in range(len(batches))], ys, width, label=e)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [str(b) for b in batches])
        ax.set_xlabel("requests at once")
        ax.set_ylabel("output tokens / s")
        ax.set_title(w)
    axes[0].legend(fontsize=7)
    dyn = [r for r in results if r["engine"] == "dynamic" and r["workload"] == "shifting"]
    if dyn:
        axes[-1].plot(dyn[0]["k_history"], lw=0.8)
        axes[-1].set_xlabel("step")
        axes[-1].set_ylabel("k chosen")
        axes[-1].set_title("dynamic-k on 'shifting'")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
