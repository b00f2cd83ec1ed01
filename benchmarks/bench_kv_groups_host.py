"""Host work per step that KV groups add, on the `experiment=gemma3_long` shape, with groups on and off.

The workload of `mrv2 bench experiment=gemma3_long` without a model: four requests of 32,000 random prompt tokens
and 128 output tokens, 2,048-token prefill chunks, 16-token blocks, Gemma 3 4B's layers (5 full, 29 with a
1,024-token window: with groups one full group and six window groups; without, one list per request that keeps
every block). A real `Scheduler` over the KV manager the run would get schedules every step; the runner's side
is replayed on CPU tensors: the block-table owner (`BlockTables` or `GroupedBlockTables`: add / append /
apply / gather / the step's KV slots) and the model's per-forward `group_metadata`. Timed per step:

    schedule      Scheduler.schedule, of which
      allocate      KVCacheManager.allocate
      release       release_out_of_window (only with groups: Gemma 3 without them frees nothing)
      cache         cache_blocks (prefix caching: hashing and publishing the filled blocks)
      find          find_cached_blocks (admission: hashing the prompt, looking its blocks up)
    tables        the runner's block-table work (staging, apply, gather, group 0's KV slots)
    metadata      group_metadata (per-group block-table views and KV slots), with its torch ops (views not counted)

Prefill steps (a 2,048-token chunk in the batch) and decode steps are reported apart: CPU time of the calling
thread (other processes on a shared machine barely move it), the mean per step of a run (the admission steps'
lookups included), the median of `--repeats` runs. The torch ops run on CPU tensors here: their count says how
many a forward runs on a GPU (where the KV slots of a group are one Triton launch, not the reference's few ops),
their CPU time is not a GPU's time. Prints a table and writes `kv_groups_host.json`.

    python benchmarks/bench_kv_groups_host.py --out bench_results/kv_groups_host
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

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from framework.batch.block_tables import BlockTables  # noqa: E402
from framework.batch.group_block_tables import GroupedBlockTables  # noqa: E402
from framework.config.schema import SchedulerConfig  # noqa: E402
from framework.engine.request import Request  # noqa: E402
from framework.engine.scheduler.kv_cache_manager import KVCacheManager  # noqa: E402
from framework.engine.scheduler.kv_groups import GroupedKVCacheManager  # noqa: E402
from framework.engine.scheduler.scheduler import Scheduler  # noqa: E402
from framework.layers.attention.kv_groups import group_metadata  # noqa: E402
from framework.layers.attention.metadata import AttentionMetadata  # noqa: E402
from framework.params.kv_groups import kv_group_layout  # noqa: E402
from framework.params.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
MAX_MODEL_LEN = 32768
GEMMA3_4B_WINDOWS = [0 if i % 6 == 5 else 1024 for i in range(34)]  # 5 full layers, 29 with a window
BLOCKS_WITHOUT_GROUPS = 28_000  # ~60 GB of 2.1 MiB blocks (34 layers); with groups 34 / 5 times as many
KV_PARTS = ("allocate", "release", "cache", "find")
PARTS = ("schedule", *KV_PARTS, "tables", "metadata")


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it that compute something (views are free: no kernel on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name.split("::")[-1] not in _VIEW_OPS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


_VIEW_OPS = {"slice", "select", "view", "unflatten", "alias", "t", "transpose", "as_strided", "unsqueeze", "expand"}


def _timed(owner: Any, name: str, part: str, acc: dict[str, float]) -> None:
    """Wrap `owner.name` so its thread CPU time adds to `acc[part]`."""
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[part] += time.thread_time() - start

    setattr(owner, name, wrapper)


def run_workload(groups: bool, args: argparse.Namespace, seed: int) -> dict[str, dict[str, float]]:
    """One pass of the workload; {"prefill" | "decode": {part: mean ms per step}} (+ "ops" per forward)."""
    layout = kv_group_layout(GEMMA3_4B_WINDOWS) if groups else None
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=args.chunk)
    kv: KVCacheManager
    if layout is not None:
        num_blocks = BLOCKS_WITHOUT_GROUPS * 34 // layout.num_tensors
        kv = GroupedKVCacheManager(num_blocks, BLOCK_SIZE, layout.group_windows, args.prefix_caching)
    else:
        kv = KVCacheManager(BLOCKS_WITHOUT_GROUPS, BLOCK_SIZE, args.prefix_caching)
    scheduler = Scheduler(config, kv, MAX_MODEL_LEN)
    acc: dict[str, float] = defaultdict(float)
    for name, part in (
        ("allocate", "allocate"),
        ("release_out_of_window", "release"),
        ("cache_blocks", "cache"),
        ("find_cached_blocks", "find"),
    ):
        _timed(kv, name, part, acc)
    device = torch.device("cpu")
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    tables = (
        GroupedBlockTables(args.requests, max_blocks, BLOCK_SIZE, device, layout)
        if layout is not None
        else BlockTables(args.requests, max_blocks, BLOCK_SIZE, device)
    )
    for i in range(args.requests):
        tokens = [rng.randrange(1, 32000) for _ in range(args.prompt)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", tokens, params))
    slots: dict[str, int] = {}
    free_slots = list(range(args.requests))
    steps: dict[str, list[dict[str, float]]] = {"prefill": [], "decode": []}
    ops: dict[str, list[int]] = {"prefill": [], "decode": []}
    while scheduler.num_unfinished:
        acc.clear()
        start = time.thread_time()
        out = scheduler.schedule()
        schedule_s = time.thread_time() - start
        # The runner: slots, the block-table owner's staging and apply, the gather and group 0's KV slots.
        start = time.thread_time()
        for request_id in out.finished_request_ids:
            if request_id in slots:
                slot = slots.pop(request_id)
                tables.remove_request(slot)
                free_slots.append(slot)
        for new in out.new_requests:
            slots[new.request_id] = free_slots.pop()
            tables.add_request(slots[new.request_id], new.block_ids)
        for cached in out.cached_requests:
            tables.append_blocks(slots[cached.request_id], cached.new_block_ids)
        tables.apply_staged_writes()
        idx_mapping = torch.tensor([slots[r] for r in out.scheduled_request_ids], dtype=torch.int32)
        counts = torch.tensor(out.num_scheduled_tokens, dtype=torch.int64)
        starts = torch.tensor(out.num_computed_tokens, dtype=torch.int64)
        rows = len(out.scheduled_request_ids)
        token_rows = torch.repeat_interleave(torch.arange(rows), counts)
        first = torch.cumsum(counts, 0) - counts
        positions = starts[token_rows] + torch.arange(int(counts.sum())) - first[token_rows]
        batch_table = tables.gather(idx_mapping)
        kv_slots = tables.kv_slot_mapping(token_rows, positions, batch_table)
        tables_s = time.thread_time() - start
        seq_lens = (starts + counts).to(torch.int32)
        meta = AttentionMetadata(
            num_tokens=int(counts.sum()),
            num_rows=rows,
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(counts, 0).to(torch.int32)]),
            seq_lens=seq_lens,
            block_tables=batch_table,
            kv_slot_mapping=kv_slots,
            block_size=BLOCK_SIZE,
            max_query_len=max(out.num_scheduled_tokens),
            max_seq_len=int(seq_lens.max()),
        )
        counter = _OpCounter()
        start = time.thread_time()
        with counter:
            group_metadata(meta, positions, layout)
        metadata_s = time.thread_time() - start
        kind = "prefill" if max(out.num_scheduled_tokens) > 1 else "decode"
        steps[kind].append(
            {"schedule": schedule_s, **{p: acc[p] for p in KV_PARTS}, "tables": tables_s, "metadata": metadata_s}
        )
        ops[kind].append(counter.ops)
        sampled = [
            [7] if c + n >= len(scheduler.requests[r].all_token_ids) else []
            for r, c, n in zip(out.scheduled_request_ids, out.num_computed_tokens, out.num_scheduled_tokens)
        ]
        scheduler.update_from_output(out, sampled)
    result: dict[str, dict[str, float]] = {}
    for kind, rows_ in steps.items():
        result[kind] = {p: 1e3 * statistics.fmean(s[p] for s in rows_) for p in PARTS}
        result[kind]["steps"] = len(rows_)
        result[kind]["ops"] = statistics.median(ops[kind])
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32_000)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="", help="a name for this checkout (e.g. before / after a change)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/kv_groups_host"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with _OpCounter():  # the first dispatch under a mode costs ~1 s of one-time set-up: not a step's
        torch.zeros(1).add(1)
    rows = []
    for groups in (False, True):
        runs = [run_workload(groups, args, seed) for seed in range(args.repeats)]
        for kind in ("prefill", "decode"):
            row: dict[str, Any] = {"groups": groups, "kind": kind}
            for key in (*PARTS, "steps", "ops"):
                row[key] = statistics.median(r[kind][key] for r in runs)
            rows.append(row)
    header = f"{'groups':>6} {'step':>7} {'n':>4} " + " ".join(f"{p:>9}" for p in PARTS) + f" {'ops':>5}"
    print(f"host ms per step (mean), {args.label or 'this checkout'}; 'ops': group_metadata's torch ops (no views)")
    print(header)
    for row in rows:
        cells = " ".join(f"{row[p]:9.3f}" for p in PARTS)
        groups = "on" if row["groups"] else "off"
        print(f"{groups:>6} {row['kind']:>7} {int(row['steps']):4d} {cells} {int(row['ops']):5d}")
    payload = {"label": args.label, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_groups_host.json").write_text(json.dumps(payload, indent=2))
    return payload


if __name__ == "__main__":
    main()
