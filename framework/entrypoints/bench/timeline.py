"""Where a benchmark run's device time went: each timed step's batch, the bytes it had to read, its device time.

`mrv2 bench bench.step_timeline=true` (GPU) records, for every step of the timed run, the scheduler's output
(rows, tokens) and the CUDA-event time of the step's device work, then groups the steps by how many rows
decode. For each group it prints the device time and a floor per step: the longer of reading the weights plus
the KV cache the step's attention reads at `HBM_BYTES_PER_S`, and the weights' multiply-adds for every token
at `DENSE_FLOPS` (attention's own FLOPs left out). Where a group's time is far above its floor, the step's
fixed cost (launch latency, short kernels) dominates; where it is near, only fewer bytes help. A step's
device time runs from its first queued kernel to its last, so it includes any wait for the host in between
(a step the host queues slower than the device runs it shows as slow).

The context of a row is counted from the tokens the run scheduled for its request so far (no preemption in
the benchmarks; a preempted request would be counted as if it kept its KV cache).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from framework.entrypoints.bench.counters import BenchCounters
from framework.entrypoints.llm import LLM
from framework.models.setup import kv_bytes_per_block
from framework.params.scheduler_output import SchedulerOutput

# What a large device-to-device copy reaches on an H200 (its spec sheet says 4.8 TB/s).
HBM_BYTES_PER_S = 4.0e12
# What a large bf16 GEMM reaches on an H200 (cuBLAS; the spec sheet's dense figure is 989 TFLOP/s).
DENSE_FLOPS = 750e12
# Steps without prompt tokens are grouped by their decode rows: 1-4, 5-16, 17-64, 65-128, 129+.
DECODE_ROW_UPPER_BOUNDS = (4, 16, 64, 128)


class StepRecord(NamedTuple):
    """One step of the timed run."""

    rows: int
    decode_rows: int  # rows of one token (a prompt chunk of one token counts too: rare)
    prompt_tokens: int  # tokens of the rows with more than one
    keys_read: int  # sum over rows of the keys attention reads: the row's context plus its new tokens
    device_ms: float


class StepGroup(NamedTuple):
    """Steps of one kind, summed."""

    name: str
    steps: int
    device_s: float
    floor_s: float  # per step the longer of weights + KV bytes at HBM_BYTES_PER_S and weight FLOPs at DENSE_FLOPS


def start_recording(llm: LLM, counters: BenchCounters) -> None:
    """From the next step on, keep each step's scheduler output (in `counters`, the observer the caller attached
    to `llm.engine`) and the runner's device-time events."""
    counters.steps = []
    llm.engine.runner.step_events = []


def stop_recording(llm: LLM, counters: BenchCounters) -> list[StepRecord]:
    """The steps since `start_recording` (waits for the device), and stop recording."""
    runner = llm.engine.runner
    outputs, events = counters.steps or [], runner.step_events
    counters.steps, runner.step_events = None, None
    if not events:
        return []
    events[-1][1].synchronize()
    context: dict[str, int] = {}
    records = []
    for out, (begin, end) in zip(outputs, events):
        records.append(_record(out, context, begin.elapsed_time(end)))
    return records


def _record(out: SchedulerOutput, context: dict[str, int], device_ms: float) -> StepRecord:
    keys = decode_rows = prompt_tokens = 0
    for request_id, n in zip(out.scheduled_request_ids, out.num_scheduled_tokens):
        before = context.get(request_id, 0)
        context[request_id] = before + n
        keys += before + n
        if n == 1:
            decode_rows += 1
        else:
            prompt_tokens += n
    return StepRecord(len(out.scheduled_request_ids), decode_rows, prompt_tokens, keys, device_ms)


def _group_name(r: StepRecord) -> str:
    if r.prompt_tokens:
        return "with prompt tokens"
    lo = 1
    for hi in DECODE_ROW_UPPER_BOUNDS:
        if r.decode_rows <= hi:
            return f"decode, {lo}-{hi} rows"
        lo = hi + 1
    return f"decode, {lo}+ rows"


def floor_s(r: StepRecord, weight_bytes: int, weight_params: int, kv_bytes_per_token: int) -> float:
    """The step's time if it only streamed its bytes or only ran its weight FLOPs, whichever is longer."""
    bytes_s = (weight_bytes + r.keys_read * kv_bytes_per_token) / HBM_BYTES_PER_S
    return max(bytes_s, 2 * weight_params * (r.decode_rows + r.prompt_tokens) / DENSE_FLOPS)


def group_steps(
    records: list[StepRecord], weight_bytes: int, weight_params: int, kv_bytes_per_token: int
) -> list[StepGroup]:
    """The steps by kind (with prompt tokens; else by decode rows), in order of first appearance."""
    sums: dict[str, list[float]] = {}
    for r in records:
        s = sums.setdefault(_group_name(r), [0, 0.0, 0.0])
        s[0] += 1
        s[1] += r.device_ms / 1e3
        s[2] += floor_s(r, weight_bytes, weight_params, kv_bytes_per_token)
    return [StepGroup(name, int(n), dev, floor) for name, (n, dev, floor) in sums.items()]


def format_groups(groups: list[StepGroup], wall_s: float) -> str:
    """A Markdown table: per kind of step its count, device time, share of the run's wall time and floor."""
    lines = [
        "| steps | count | device s | of wall | floor s | device / floor | ms per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in groups + [
        StepGroup("all", sum(g.steps for g in groups), sum(g.device_s for g in groups), sum(g.floor_s for g in groups))
    ]:
        lines.append(
            f"| {g.name} | {g.steps} | {g.device_s:.3f} | {100 * g.device_s / wall_s:.1f} % | "
            f"{g.floor_s:.3f} | {g.device_s / max(g.floor_s, 1e-12):.2f} | {1e3 * g.device_s / g.steps:.3f} |"
        )
    lines.append(f"\nwall {wall_s:.3f} s; device idle {max(0.0, wall_s - sum(g.device_s for g in groups)):.3f} s")
    return "\n".join(lines)


def write_timeline(llm: LLM, records: list[StepRecord], wall_s: float, out_dir: Path) -> str:
    """timeline.json (every step), timeline.png (device ms and decode rows per step); returns the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = llm.engine.loaded
    weight_params = sum(p.numel() for p in loaded.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    kv_per_token = kv_bytes_per_block(loaded, 1)
    groups = group_steps(records, weight_bytes, weight_params, kv_per_token)
    table = format_groups(groups, wall_s)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "timeline.json").write_text(
        json.dumps(
            {
                "wall_s": wall_s,
                "weight_bytes": weight_bytes,
                "weight_params": weight_params,
                "kv_bytes_per_token": kv_per_token,
                "hbm_bytes_per_s": HBM_BYTES_PER_S,
                "dense_flops": DENSE_FLOPS,
                "groups": [g._asdict() for g in groups],
                "steps": [r._asdict() for r in records],
            },
            indent=1,
        )
    )
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([r.device_ms for r in records], lw=0.8, label="device ms")
    ax.plot([1e3 * floor_s(r, weight_bytes, weight_params, kv_per_token) for r in records], lw=0.8, label="floor ms")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    rows = ax.twinx()
    rows.plot([r.decode_rows for r in records], color="gray", lw=0.6, label="decode rows")
    rows.set_ylabel("decode rows")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out_dir / "timeline.png", dpi=120)
    plt.close(fig)
    return table
