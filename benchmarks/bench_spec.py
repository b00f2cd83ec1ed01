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

The modules are in `benchmarks/spec/`: `workloads` (engines, requests), `runs` (timed runs, rounds, warm-up),
`report` (comparisons, table, plot).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # host_speed and spec/, when imported from elsewhere
from host_speed import fastest_policy, fastest_probe  # noqa: E402
from spec.report import compare, plot, print_table  # noqa: E402
from spec.runs import (  # noqa: E402
    median_run,
    pair_deadline,
    run_once,
    run_pairs,
    run_round_robin,
    set_policy,
    warm_up,
)
from spec.workloads import BATCH_SIZES, FIXED_KS, K_MAX, build_llm, workload  # noqa: E402


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


if __name__ == "__main__":
    main()
