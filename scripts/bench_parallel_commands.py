"""Per-step cost of the driver's command to the other ranks: pickle (`broadcast_object_list`, the old path,
kept here only as the baseline) against typed msgpack bytes (`encode_command` + `broadcast_bytes` +
`decode_command`, the path the engine uses). Two processes on the CPU over gloo (TP=2's command group).

    python3 scripts/bench_parallel_commands.py [--rows 64] [--iters 300]

Each iteration: the driver sends one step command, the worker decodes it, then a 1-element all-reduce (the ack)
so the driver's clock covers the worker's decode. The ack alone is timed too. Also prints the single-process
encode + decode time and the encoded size. Numbers depend on the host: docs/parallelism.md says which.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from framework.executor.messages import Command, decode_command, encode_command
from framework.layers.parallel.context import ParallelContext
from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


def decode_step(rows: int) -> SchedulerOutput:
    """A decode step of `rows` running requests, a few gaining a block, with one new request of 512 tokens."""
    new = [
        NewRequestData(
            "new", list(range(512)), 512, SamplingParams(temperature=0.6, top_p=0.9, seed=1), 1, list(range(32)), 0
        )
    ]
    ids = [f"req-{i}" for i in range(rows)] + ["new"]
    cached = [CachedRequestData(f"req-{i}", [1000 + i]) for i in range(0, rows, 16)]  # only rows gaining blocks
    return SchedulerOutput(
        ids, [1] * rows + [512], [0] * (rows + 1), new, cached, {"gone"}, 0, list(range(100, 100 + rows)) + [0]
    )


def _timed(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def _rank(rank: int, port: int, rows: int, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ctx = ParallelContext(tp_size=2, rank=rank, cpu_group=dist.group.WORLD)  # driver: rank 0 of one stage
    step = Command("step", decode_step(rows))
    ack = torch.zeros(1)

    def pickled() -> None:
        box = [step if ctx.is_driver else None]
        dist.broadcast_object_list(box, src=0)
        dist.all_reduce(ack)

    def typed() -> None:
        data = ctx.broadcast_bytes(encode_command(step) if ctx.is_driver else None)
        if not ctx.is_driver:
            decode_command(data)
        dist.all_reduce(ack)

    results = {
        name: _timed(fn, iters)
        for name, fn in (("ack only", lambda: dist.all_reduce(ack)), ("pickle", pickled), ("msgpack", typed))
    }
    if ctx.is_driver:
        print(
            f"TP=2 on the CPU (gloo), {os.cpu_count()} visible cores, decode step of {rows} rows + 1 new "
            f"512-token request, {iters} iterations"
        )
        print(f"pickled size {len(pickle.dumps(step.payload))} B, msgpack size {len(encode_command(step))} B")
        local_pickle = _timed(lambda: pickle.loads(pickle.dumps(step)), iters)
        local_msgpack = _timed(lambda: decode_command(encode_command(step)), iters)
        print(f"{'path':10s} {'round trip us':>14s} {'minus ack us':>13s} {'encode+decode alone us':>23s}")
        for name, local in (("pickle", local_pickle), ("msgpack", local_msgpack)):
            print(f"{name:10s} {results[name]:14.1f} {results[name] - results['ack only']:13.1f} {local:23.1f}")
        print(f"{'ack only':10s} {results['ack only']:14.1f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, args.rows, args.iters), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
