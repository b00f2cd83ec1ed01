"""How `bench_spec.py` times: one run of a cell's requests (tokens/s, every step's host and device time, host
probes around it), the round-robin over a cell's policies, the paired rounds of the best fixed k and dynamic-k,
and the warm-up before them."""

from __future__ import annotations

import gc
import time
from typing import Any, Optional

import torch
from host_speed import fast_runs, fastest_probe, host_probe_us

from .workloads import workload


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
