"""Host overhead per decode step, V2 against V1, with the model replaced by a stub.

Every request of the batch decodes one token per step; the model's forward returns a preallocated zero
tensor and `compute_logits` a preallocated zero logits block, so what is left is the runners' own work:
state updates, input preparation, attention metadata, sampling bookkeeping and the scheduler.

Each step is timed in four phases (the four lines of `EngineCore.step`), as wall time and as CPU time of
the calling thread:

    schedule   Scheduler.schedule                       (the same code for both runners)
    execute    runner.execute_model                     (state updates, inputs, attention metadata, stub forward)
    sample     runner.sample_tokens().get()             (stub logits, sampler, post-update, copy to the host)
    update     Scheduler.update_from_output             (the same code for both runners)

On a CPU-only machine the device work of V2 (its PyTorch reference kernels) also runs on the CPU and is
counted; on a GPU it is launched asynchronously and only the launch cost shows. Prints a table, writes
`host_overhead.json` and `host_overhead.png` into `--out`.

    python scripts/bench_host_overhead.py --sizes 64 256 1024 --steps 20 --out bench_results/host_overhead
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PHASES = ("schedule", "execute", "sample", "update")


def build_engine(runner: str, num_requests: int, prompt_len: int, num_steps: int, device: str):  # type: ignore[no-untyped-def]
    """A tiny-preset engine sized for `num_requests` decoding at once, its model replaced by a stub."""
    from framework import LLM

    block_size = 16
    max_model_len = prompt_len + num_steps + 8
    blocks_per_req = -(-max_model_len // block_size)
    llm = LLM(
        "random_tiny",
        device=device,
        runner=runner,
        max_num_seqs=num_requests,
        max_model_len=max_model_len,
        max_num_batched_tokens=num_requests * prompt_len,
        block_size=block_size,
        num_kv_blocks=num_requests * blocks_per_req,
        seed=0,
        cuda_graphs=False,
    )  # the stub forward has nothing to capture
    engine = llm.engine
    model = engine.runner.model
    dev, dtype = engine.loaded.device, engine.loaded.dtype
    hidden = torch.zeros(num_requests * prompt_len, model.config.hidden_size, dtype=dtype, device=dev)
    logits = torch.zeros(num_requests, engine.loaded.vocab_size, dtype=torch.float32, device=dev)

    def stub_forward(input_ids, positions, kv_caches, attn_metadata, **extra):  # type: ignore[no-untyped-def]
        return hidden[: input_ids.shape[0]]

    model.forward = stub_forward  # nn.Module.__call__ finds the instance attribute
    model.compute_logits = lambda rows: logits[: rows.shape[0]]
    return engine


def timed_step(engine, records: dict[str, list[tuple[float, float]]]) -> None:  # type: ignore[no-untyped-def]
    """`EngineCore.step`, one phase at a time, recording (wall, thread CPU) seconds per phase."""
    marks = [(time.perf_counter(), time.thread_time())]
    scheduler_output = engine.scheduler.schedule()
    marks.append((time.perf_counter(), time.thread_time()))
    engine.runner.execute_model(scheduler_output)
    marks.append((time.perf_counter(), time.thread_time()))
    runner_output = engine.runner.sample_tokens().get()
    marks.append((time.perf_counter(), time.thread_time()))
    engine.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
    marks.append((time.perf_counter(), time.thread_time()))
    assert len(scheduler_output.scheduled_request_ids) == len(engine.scheduler.running)
    for phase, (start, end) in zip(PHASES, zip(marks, marks[1:])):
        records[phase].append((end[0] - start[0], end[1] - start[1]))


def measure(runner: str, num_requests: int, args: argparse.Namespace) -> dict:
    from framework import SamplingParams

    engine = build_engine(runner, num_requests, args.prompt_len, args.warmup + args.steps, args.device)
    params = SamplingParams(
        temperature=args.temperature, seed=1, max_tokens=args.warmup + args.steps + 4, ignore_eos=True
    )
    for i in range(num_requests):
        engine.add_request(f"b{i}", [(7 * i + k) % 256 for k in range(args.prompt_len)], params)
    engine.step()  # every prefill in one step
    records: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASES}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            records = {p: [] for p in PHASES}
        timed_step(engine, records)
    result = {"runner": runner, "num_requests": num_requests, "steps": args.steps}
    for phase in PHASES:
        result[f"{phase}_wall_ms"] = 1e3 * statistics.median(w for w, _ in records[phase])
        result[f"{phase}_cpu_ms"] = 1e3 * statistics.median(c for _, c in records[phase])
    result["step_wall_ms"] = sum(result[f"{p}_wall_ms"] for p in PHASES)
    result["step_cpu_ms"] = sum(result[f"{p}_cpu_ms"] for p in PHASES)
    result["runner_cpu_ms"] = result["execute_cpu_ms"] + result["sample_cpu_ms"]
    return result


def format_table(results: list[dict]) -> str:
    head = (
        f"{'runner':<7}{'requests':>9}"
        + "".join(f"{p + ' ms':>13}" for p in PHASES)
        + f"{'runner ms':>11}{'step ms':>10}{'step wall':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r['runner']:<7}{r['num_requests']:>9}"
            + "".join(f"{r[p + '_cpu_ms']:>13.3f}" for p in PHASES)
            + f"{r['runner_cpu_ms']:>11.3f}{r['step_cpu_ms']:>10.3f}{r['step_wall_ms']:>11.3f}"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path, device_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for runner, marker, color in (("v2", "o", "tab:blue"), ("v1", "s", "tab:orange")):
        rows = [r for r in results if r["runner"] == runner]
        if not rows:
            continue
        sizes = [r["num_requests"] for r in rows]
        ax.plot(
            sizes,
            [r["runner_cpu_ms"] for r in rows],
            marker=marker,
            color=color,
            label=f"{runner}: runner (execute + sample)",
        )
        ax.plot(
            sizes,
            [r["step_cpu_ms"] for r in rows],
            marker=marker,
            color=color,
            linestyle="--",
            alpha=0.5,
            label=f"{runner}: whole step (with scheduler)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("running requests (one decode token each)")
    ax.set_ylabel("CPU ms per decode step (median)")
    ax.set_title(f"mrv2 host overhead, model stubbed ({device_name})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="running requests")
    parser.add_argument("--runners", nargs="+", default=["v2", "v1"], choices=["v2", "v1"])
    parser.add_argument("--steps", type=int, default=20, help="measured decode steps per size")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps run before measuring")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (sampler stages skipped)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = steadier host timings)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/host_overhead"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device_name = torch.cuda.get_device_name() if args.device != "cpu" and torch.cuda.is_available() else "cpu"

    # The first engine built in a process runs its large temporaries measurably slower for its whole life
    # (allocator warm-up; seen as a 2x slower sampler at 1024 requests): build and run one, then discard it.
    measure(args.runners[0], max(args.sizes), argparse.Namespace(**{**vars(args), "warmup": 0, "steps": 2}))
    results = []
    for size in args.sizes:
        for runner in args.runners:
            print(f"measuring {runner} with {size} requests", file=sys.stderr)
            results.append(measure(runner, size, args))
    print(f"CPU ms per decode step (median of {args.steps}), device {device_name}, model stubbed")
    print(format_table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": device_name,
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
    }
    (args.out / "host_overhead.json").write_text(json.dumps(payload, indent=2))
    plot(results, args.out / "host_overhead.png", device_name)
    print(f"results written to {args.out}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
