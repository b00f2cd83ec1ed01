"""Host bookkeeping per engine step with the runner replaced by a fake: scheduler, output processing, engine.

`EngineCore.step` runs as in serving, but its runner returns one made-up token per sampling row at once (no
model, no device, no input preparation), so what is timed is the engine's own per-step work around the runner:

    schedule   Scheduler.schedule              (rows, KV blocks, preemption, admission, SchedulerOutput)
    update     Scheduler.update_from_output    (append tokens, stop conditions, finishes)
    process    OutputProcessor.process         (RequestOutputs, detokenizing, stop strings)
    engine     the rest of EngineCore.step     (async hand-off, error codes, n > 1 relabelling)
    add        EngineCore.add_request          (only in "churn": the requests that replace finished ones; their
                                                prompts and SamplingParams, the caller's work, are made untimed)

Two workloads at each size: "decode" keeps `--size` requests decoding (nothing finishes while timed);
"churn" gives each request 16-48 output tokens and replaces every finished request with a new one, so a few
rows finish and a few prefill every step. CPU time of the calling thread, median over the timed steps,
then the median of `--repeats` runs. Prints a table, writes `step_bookkeeping.json` and
`step_bookkeeping.png` into `--out`.

    python benchmarks/bench_step_bookkeeping.py --sizes 64 256 --steps 200 --out bench_results/step_bookkeeping

`--baseline OLD/step_bookkeeping.json` (a run of an earlier checkout) puts that version's numbers beside these in
the table and the plot.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("schedule", "update", "process", "engine", "add")
WORKLOADS = ("decode", "churn")
PROMPT_LEN = 32


class _Ready:
    def __init__(self, output: Any) -> None:
        self.output = output

    def get(self) -> Any:
        return self.output


class FakeRunner:
    """Stands in for a model runner: every row that reaches the end of its tokens samples token 7."""

    name = "fake"

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._output: Any = None

    def execute_model(self, output: Any) -> None:
        self._output = output

    def kv_connector_output(self) -> Any:
        from framework.params.kv_transfer import EMPTY_KV_CONNECTOR_OUTPUT

        return EMPTY_KV_CONNECTOR_OUTPUT

    def sample_tokens(self) -> _Ready:
        from framework.runner.async_output import ModelRunnerOutput

        out, requests = self._output, self.scheduler.requests
        sampled = []
        for request_id, before, n, drafts in zip(
            out.scheduled_request_ids, out.num_computed_tokens, out.num_scheduled_tokens, out.num_draft_tokens
        ):
            request = requests.get(request_id)
            samples = request is not None and before + n - drafts >= request.num_tokens
            sampled.append([7] if samples else [])
        # Per-row error codes, all 0, as the V2 runner's sampler reports them.
        return _Ready(ModelRunnerOutput(list(out.scheduled_request_ids), sampled, errors=[0] * len(sampled)))


def _timed(clock: dict[str, float], name: str, fn: Callable) -> Callable:
    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            clock[name] += time.thread_time() - start

    return wrapper


def measure(workload: str, size: int, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Median CPU us per step of each phase, over `args.steps` steps after `args.warmup`."""
    from framework import LLM, SamplingParams

    steps = args.warmup + args.steps
    max_model_len = PROMPT_LEN + (steps + 8 if workload == "decode" else 64)
    blocks = size * -(-max_model_len // 16) + 16
    llm = LLM(
        "random_tiny",
        device="cpu",
        max_num_seqs=size,
        max_model_len=max_model_len,
        seed=seed,
        max_num_batched_tokens=max(size * PROMPT_LEN, 2048),
        block_size=16,
        num_kv_blocks=blocks,
        cuda_graphs=False,
        enable_prefix_caching=False if args.no_prefix_caching else None,
    )
    engine = llm.engine
    engine.runner = FakeRunner(engine.scheduler)
    rng = random.Random(seed)
    arrivals = iter(range(1 << 30))

    def arrival() -> tuple[str, list[int], Any]:
        i = next(arrivals)
        max_tokens = steps + 4 if workload == "decode" else rng.randint(16, 48)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=args.output_kind, seed=i)
        return f"q{i}", [rng.randrange(1, 250) for _ in range(PROMPT_LEN)], params

    def add() -> None:
        engine.add_request(*arrival())

    for _ in range(size):
        add()
    clock: dict[str, float] = defaultdict(float)
    sched, proc = engine.scheduler, engine.output_processor
    sched.schedule = _timed(clock, "schedule", sched.schedule)
    sched.update_from_output = _timed(clock, "update", sched.update_from_output)
    proc.process = _timed(clock, "process", proc.process)
    runner = engine.runner
    runner.execute_model = _timed(clock, "runner", runner.execute_model)
    runner.sample_tokens = _timed(clock, "runner", runner.sample_tokens)
    per_step: dict[str, list[float]] = {p: [] for p in PHASES}
    for _ in range(4 if workload == "decode" else 60):  # prefill, then (churn) until arrivals and finishes mix
        _refill(engine, add, workload, size)
    for step in range(steps):
        clock.clear()
        start = time.thread_time()
        engine.step()
        total = time.thread_time() - start
        # The caller's part of an arrival (its prompt and SamplingParams) is made before the clock starts.
        pending = [arrival() for _ in range(size - engine.scheduler.num_unfinished)] if workload == "churn" else []
        start = time.thread_time()
        for request in pending:
            engine.add_request(*request)
        clock["add"] = time.thread_time() - start
        clock["engine"] = total - sum(clock[p] for p in ("schedule", "update", "process", "runner"))
        if step >= args.warmup:
            for phase in PHASES:
                per_step[phase].append(clock[phase])
    assert workload != "decode" or len(engine.scheduler.running) == size
    llm.shutdown()
    return {phase: 1e6 * statistics.median(values) for phase, values in per_step.items()}


def _refill(engine: Any, add: Callable[[], None], workload: str, size: int) -> None:
    engine.step()
    if workload == "churn":
        for _ in range(size - engine.scheduler.num_unfinished):
            add()


def format_table(rows: list[dict], baseline: list[dict] | None = None) -> str:
    """One line per (workload, size); with a baseline, its line first and the change of the total after."""
    label = "version   " if baseline else ""
    head = f"{label}{'workload':<9}{'requests':>9}" + "".join(f"{p + ' us':>12}" for p in PHASES) + f"{'total us':>11}"
    lines = [head, "-" * len(head)]
    before = {(r["workload"], r["requests"]): r for r in baseline or []}

    def line(tag: str, r: dict) -> str:
        return (
            f"{tag}{r['workload']:<9}{r['requests']:>9}"
            + "".join(f"{r[p]:>12.1f}" for p in PHASES)
            + f"{r['total']:>11.1f}"
        )

    for r in rows:
        old = before.get((r["workload"], r["requests"]))
        if baseline is None:
            lines.append(line("", r))
        elif old is not None:
            lines.append(line(f"{'before':<10}", old))
            lines.append(line(f"{'after':<10}", r) + f"  (x{r['total'] / old['total']:.2f})")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str, baseline: list[dict] | None = None) -> None:
    """Stacked bars of the phases per (workload, size), divided by the running requests (so that 64 and 1024
    rows share one scale); with a baseline, its bar (hatched) beside each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    before = {(r["workload"], r["requests"]): r for r in baseline or []}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.38 if baseline else 0.7
    for x, r in enumerate(rows):
        bars = [(x + width / 2, r, "")] if baseline else [(x, r, "")]
        old = before.get((r["workload"], r["requests"]))
        if old is not None:
            bars.append((x - width / 2, old, "//"))
        for pos, row, hatch in bars:
            bottom = 0.0
            for i, phase in enumerate(PHASES):
                value = row[phase] / row["requests"]
                ax.bar(
                    pos,
                    value,
                    width,
                    bottom=bottom,
                    color=colors[i % len(colors)],
                    hatch=hatch,
                    edgecolor="white",
                    label=phase if x == 0 and not hatch else None,
                )
                bottom += value
    ax.set_xticks(range(len(rows)), [f"{r['workload']}\n{r['requests']}" for r in rows])
    ax.set_ylabel("CPU us per step per running request")
    ax.set_xlabel("workload / running requests" + ("  (hatched: before)" if baseline else ""))
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256], help="running requests")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the table shows their median")
    parser.add_argument("--output-kind", default="final_only", choices=["final_only", "delta", "cumulative"])
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not publish filled blocks (hashing)")
    parser.add_argument("--label", default="", help="a name for this code version in the JSON and the plot")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="step_bookkeeping.json of an earlier version (e.g. before a change): shown side by side",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/step_bookkeeping"))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = []
    for workload in args.workloads:
        for size in args.sizes:
            print(f"measuring {workload} with {size} requests", file=sys.stderr)
            runs = [measure(workload, size, args, seed) for seed in range(args.repeats)]
            row: dict[str, Any] = {"workload": workload, "requests": size}
            row.update({p: statistics.median(run[p] for run in runs) for p in PHASES})
            row["total"] = sum(row[p] for p in PHASES)
            row["runs"] = runs
            rows.append(row)
    title = f"engine bookkeeping per step, fake runner (CPU){' ' + args.label if args.label else ''}"
    print(
        f"CPU us per step, median of {args.steps} steps, median of {args.repeats} runs "
        f"(output_kind={args.output_kind}{', prefix caching off' if args.no_prefix_caching else ''})"
    )
    baseline = json.loads(args.baseline.read_text())["rows"] if args.baseline is not None else None
    print(format_table(rows, baseline))
    args.out.mkdir(parents=True, exist_ok=True)
    import framework

    payload = {
        "label": args.label,
        "framework": str(Path(framework.__file__).parent),
        "baseline": baseline,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    (args.out / "step_bookkeeping.json").write_text(json.dumps(payload, indent=2))
    plot(rows, args.out / "step_bookkeeping.png", title, baseline)
    print(f"results written to {args.out}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
