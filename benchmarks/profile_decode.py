"""Where a decode step's time goes: host phases, device kernels, and the gaps between them.

Builds the "nano" engine (Qwen3-0.6B geometry, random bf16 weights), fills `--batch` slots with
`--prompt-len`-token prompts, and runs pure decode steps three times:

1. phase timing: wall and thread CPU time of each line of `EngineCore.step` (schedule, execute, sample, wait,
   update, process), their sum without the wait (`host`) and the rest of the step (`engine_other`);
2. `torch.profiler`: device time per kernel and host time per op, and the device's busy fraction
   (sum of kernel time over the wall time);
3. `cProfile`: the Python functions the host spends its time in.

With `--profile-prefill`, the prefill steps first: their phases, a kernel table, their chrome trace
(`prefill_trace.json`), their kernel time per step against their unprofiled wall time per step (the device's
busy fraction: well below 1 when the host queues prefill steps slower than the device runs them) and the
`cProfile` tables of their host functions.

Writes `profile.txt` (everything printed) and `profile.json` (the numbers) into `--out`.

    python benchmarks/profile_decode.py --batch 256 --steps 100 --out /tmp/profile_decode
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from framework.entrypoints.bench.counters import BenchCounters
from speculators.policy import DraftLengthPolicy


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from framework import LLM
    from framework.config.schema import load_config

    config = load_config(
        {
            "model": {
                "preset": args.preset,
                "max_model_len": args.max_model_len,
            },
            "kernels": {"small_batch": args.small_batch_kernels, "programmatic_launch": args.programmatic_launch},
            "scheduler": {"max_num_seqs": max(args.batch, 1), "max_num_batched_tokens": 8192},
            # dynamic_k: decode graphs for every k in 0..5 (a fixed-k engine captures 0 and 5 only)
            "speculator": (
                {"method": "none"}
                if args.spec_k is None
                else {
                    "method": "ngram",
                    "dynamic_k": True,
                    "num_speculative_tokens": 5,
                    "prompt_lookup_min": 2,
                    "prompt_lookup_max": 5,
                }
            ),
            "runner": {"full_step_cuda_graphs": args.full_step_graphs, "prefill_cuda_graphs": args.prefill_graphs},
            "device": args.device,
            "seed": 0,
        }
    )
    engine = LLM(config=config).engine
    if args.spec_k is not None:  # held at a fixed draft length (as benchmarks/bench_spec.py does)
        from speculators.policy import FixedK

        ks = [int(k) for k in args.spec_k.split(",")]
        engine.draft_policy = engine.scheduler.draft_policy = FixedK(ks[0]) if len(ks) == 1 else CyclingK(ks)
    return engine


class CyclingK(DraftLengthPolicy):
    """A draft-length policy that cycles through a list of k (what switching k every step costs)."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(max(ks))
        self.ks, self.step = ks, 0

    def choose(self, request_ids) -> int:  # type: ignore[no-untyped-def]
        self.step += 1
        return self.ks[self.step % len(self.ks)]


def fill(engine, args: argparse.Namespace, settle_steps: int = 5) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """`--batch` running requests, prefilled (timed: the first prefill steps include Triton compiles), then
    `settle_steps` decode steps (untimed)."""
    from framework import SamplingParams

    vocab = engine.loaded.vocab_size
    for i in range(args.batch):
        period = 16 if args.repeat_prompt else args.prompt_len  # a repeated segment: ngram drafts get accepted
        engine.add_request(
            f"p{i}",
            [(i * 131 + (j % period) * 7) % vocab for j in range(args.prompt_len)],
            SamplingParams(
                temperature=args.temperature,
                max_tokens=args.max_model_len - 1 - args.prompt_len,
                ignore_eos=True,
                seed=i,
                logprobs=args.logprobs,
            ),
        )
    _sync()
    start, steps = time.perf_counter(), 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
        steps += 1
    _sync()
    seconds = time.perf_counter() - start
    for _ in range(settle_steps):
        engine.step()
    _sync()
    return {
        "tokens": args.batch * args.prompt_len,
        "steps": steps,
        "seconds": seconds,
        "tok_per_s": args.batch * args.prompt_len / seconds,
    }


def drain(engine, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    """Abort the `fill` requests and forget their prefixes: the same prompts again are computed, not cache hits."""
    for i in range(args.batch):
        engine.abort_request(f"p{i}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def timed(records: dict[str, float], name: str, fn: Callable, cpu: dict[str, float] | None = None) -> Callable:
    def wrapper(*a: Any, **k: Any) -> Any:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            records[name] += time.perf_counter() - start
            if cpu is not None:
                cpu[name] += time.thread_time() - start_cpu

    return wrapper


HOST_PHASES = ("schedule", "execute_model", "sample_tokens", "update_from_output", "output_processor")


def phase_times(
    engine,
    steps: int,  # type: ignore[no-untyped-def]
    run: Callable[[], int] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Mean ms per step of each phase of `EngineCore.step`, by wrapping the callees on the instances: wall time,
    and CPU time of the engine's thread (what the host spends itself, waits excluded). The steps are `steps`
    calls of `engine.step()`, or whatever `run` does (it returns how many steps it ran: the prefill of `fill`).

    Wall also gets `host` (the five host phases, the wait for the device's output excluded), `engine_other`
    (the rest of `EngineCore.step`) and `step_wall`."""
    from framework.runner.async_output import AsyncOutput

    records: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    sched, runner, proc = engine.scheduler, engine.runner, engine.output_processor
    saved_get = AsyncOutput.get
    sched.schedule = timed(records, "schedule", sched.schedule, cpu)
    runner.execute_model = timed(records, "execute_model", runner.execute_model, cpu)
    runner.sample_tokens = timed(records, "sample_tokens", runner.sample_tokens, cpu)
    sched.update_from_output = timed(records, "update_from_output", sched.update_from_output, cpu)
    proc.process = timed(records, "output_processor", proc.process, cpu)
    AsyncOutput.get = timed(records, "wait_output", AsyncOutput.get, cpu)
    step = engine.step
    engine.step = timed(records, "step", step, cpu)
    try:
        _sync()
        start = time.perf_counter()
        if run is None:
            for _ in range(steps):
                engine.step()
        else:
            steps = run()
        _sync()
        wall = time.perf_counter() - start
    finally:
        AsyncOutput.get = saved_get  # type: ignore[method-assign]
        del sched.schedule, runner.execute_model, runner.sample_tokens, sched.update_from_output, proc.process
        del engine.step
    out = {name: 1e3 * t / steps for name, t in records.items() if name != "step"}
    out["host"] = sum(out.get(p, 0.0) for p in HOST_PHASES)
    out["engine_other"] = 1e3 * records["step"] / steps - out["host"] - out.get("wait_output", 0.0)
    out["step_wall"] = 1e3 * wall / steps
    out_cpu = {name: 1e3 * t / steps for name, t in cpu.items()}
    out_cpu["host"] = sum(out_cpu.get(p, 0.0) for p in HOST_PHASES)
    return out, out_cpu


KERNEL_LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
GRAPH_LAUNCH_CALLS = {"cudaGraphLaunch", "cuGraphLaunch"}


def kernel_ms(events) -> float:  # type: ignore[no-untyped-def]
    """Milliseconds of device time in a profiler's `key_averages()`."""
    return sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e3


def kernel_profile(engine, steps: int, out: Path) -> tuple[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = time.perf_counter() - start
    prof.export_chrome_trace(str(out / "trace.json"))
    events = prof.key_averages()
    text = events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    text += "\n" + events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    # Host-side launch calls: kernels launched one by one (outside any graph) and graph replays.
    launches = sum(e.count for e in events if e.key in KERNEL_LAUNCH_CALLS)
    graph_launches = sum(e.count for e in events if e.key in GRAPH_LAUNCH_CALLS)
    numbers = {
        "wall_ms_per_step": 1e3 * wall / steps,
        "kernel_ms_per_step": kernel_ms(events) / steps,
        "kernels_per_step": kernels / steps,
        "launches_outside_graphs_per_step": launches / steps,
        "graph_launches_per_step": graph_launches / steps,
    }
    numbers["device_busy_fraction"] = numbers["kernel_ms_per_step"] / numbers["wall_ms_per_step"]
    return text, numbers


def python_profile(run: Callable[[], Any]) -> str:
    """cProfile's tables (by own time, by cumulative time) of the host functions `run` spends its time in."""
    prof = cProfile.Profile()
    _sync()
    prof.enable()
    run()
    _sync()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumtime").print_stats(45)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--profile-prefill", action="store_true", help="also a kernel table of the prefill steps")
    parser.add_argument(
        "--spec-k", default=None, help="profile an ngram engine held at this k (a comma list: cycle through those k)"
    )
    parser.add_argument(
        "--repeat-prompt",
        action="store_true",
        help="prompts repeat a 16-token segment (with --temperature 0: high ngram acceptance)",
    )
    parser.add_argument(
        "--small-batch-kernels",
        default="off",
        choices=["auto", "on", "off"],
        help="kernels.small_batch: the fused GEMV path at <= 8 tokens (docs/kernels.md)",
    )
    parser.add_argument(
        "--programmatic-launch",
        default="auto",
        choices=["auto", "on", "off"],
        help="kernels.programmatic_launch: PDL for the small-batch path's kernels (docs/kernels.md)",
    )
    parser.add_argument(
        "--full-step-graphs",
        action="store_true",
        help="runner.full_step_cuda_graphs: a pure-decode step replays as one graph",
    )
    parser.add_argument(
        "--prefill-graphs",
        action="store_true",
        help="runner.prefill_cuda_graphs: prompt steps replay graph pieces between eager attentions",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="every request asks for this many top logprobs (full-step graphs: the general variant)",
    )
    parser.add_argument("--device", default="auto", help="cpu runs a smoke check of this script")
    parser.add_argument("--out", type=Path, default=Path("bench_results/profile_decode"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    engine = build_engine(args)
    counters = BenchCounters()  # full-step replays and fallbacks over the whole run
    engine.set_observer(counters)
    report: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        report.append(line)

    fill(engine, args)  # compiles the kernels
    drain(engine, args)
    prefill = fill(engine, args)
    prefill_phases: dict[str, dict[str, float]] = {}
    if args.profile_prefill:  # the prefill steps' host phases, then once more under the profiler (device time)
        drain(engine, args)
        wall, thread = phase_times(engine, 0, run=lambda: int(fill(engine, args, settle_steps=0)["steps"]))
        prefill_phases = {"wall_ms": wall, "cpu_ms": thread}
        say(f"phases, wall ms per prefill step at batch {args.batch} (prompt {args.prompt_len}):")
        say("  " + "  ".join(f"{k}={v:.3f}" for k, v in wall.items()))
        say("phases, CPU ms of the engine thread per prefill step:")
        say("  " + "  ".join(f"{k}={v:.3f}" for k, v in thread.items()))
        from torch.profiler import ProfilerActivity, profile

        drain(engine, args)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            profiled = fill(engine, args, settle_steps=0)  # prefill steps only
        for _ in range(5):  # the decode measurements below start settled, as before
            engine.step()
        prof.export_chrome_trace(str(args.out / "prefill_trace.json"))
        events = prof.key_averages()
        say(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
        # The kernels' time per prefill step against the step's wall time without the profiler (`prefill`, the
        # fill before): a busy fraction well below 1 means the host queues the steps slower than the device runs them.
        step_kernel_ms = kernel_ms(events) / max(1, int(profiled["steps"]))
        wall_ms = 1e3 * prefill["seconds"] / max(1, int(prefill["steps"]))
        prefill_phases["device"] = {
            "kernel_ms_per_step": step_kernel_ms,
            "wall_ms_per_step": wall_ms,
            "device_busy_fraction": step_kernel_ms / wall_ms,
        }
        say(
            f"prefill steps: kernels {step_kernel_ms:.2f} ms a step (profiled fill), wall {wall_ms:.2f} ms a step "
            f"(unprofiled fill): device busy {step_kernel_ms / wall_ms:.2f}"
        )
        drain(engine, args)  # where the host's time in prefill steps goes (function by function)
        say(f"host functions of one fill's prefill steps ({int(prefill['steps'])} steps):")
        say(python_profile(lambda: fill(engine, args, settle_steps=0)))
        for _ in range(5):
            engine.step()
    say(
        f"prefill: {prefill['tokens']} prompt tokens in {prefill['steps']} steps, {prefill['seconds']:.3f} s "
        f"({prefill['tok_per_s']:.0f} tok/s)"
    )

    phases, phases_cpu = phase_times(engine, args.steps)
    say(f"phases, wall ms per decode step at batch {args.batch} (prompt {args.prompt_len}):")
    say("  " + "  ".join(f"{k}={v:.3f}" for k, v in phases.items()))
    say("phases, CPU ms of the engine thread per decode step:")
    say("  " + "  ".join(f"{k}={v:.3f}" for k, v in phases_cpu.items()))
    table, kernels = kernel_profile(engine, min(args.steps, 30), args.out)
    say("profiler: " + "  ".join(f"{k}={v:.3f}" for k, v in kernels.items()))
    say(table)
    say(python_profile(lambda: [engine.step() for _ in range(args.steps)]))
    full_step = {"replays": counters.full_step_replays, "fallbacks": dict(counters.full_step_fallbacks)}
    say(f"full-step graphs: {full_step['replays']} steps replayed whole; fallbacks by reason: {full_step['fallbacks']}")
    (args.out / "profile.txt").write_text("\n".join(report))
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "prefill": prefill,
        "prefill_phases": prefill_phases,
        "phases_ms": phases,
        "phases_cpu_ms": phases_cpu,
        "profiler": kernels,
        "full_step_graphs": full_step,
    }
    (args.out / "profile.json").write_text(json.dumps(result, indent=2))
    print(f"results written to {args.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
