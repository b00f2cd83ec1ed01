"""The driver rank: the engine's runner under parallelism, repeating each call to every worker first.

`DriverRunner` wraps the driver's own `ModelRunnerV2`. Each call the engine makes is first broadcast as a
`Command` to the workers (typed msgpack on the gloo group, see `messages`), then run locally, so every rank
runs the same step on the same `SchedulerOutput` and joins the same collectives. Only the driver's
`AsyncOutput` carries results.
"""

from __future__ import annotations

import logging
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch

from framework.config.schema import ConfigError, Mrv2Config
from framework.executor.launch import (
    RankPlace,
    check_parallel_config,
    free_port,
    init_groups,
    rank_device,
    torchrun_place,
)
from framework.executor.messages import Command, encode_command
from framework.executor.worker import SHUTDOWN_MEET, build_rank, leave_groups, serve, worker_main
from framework.layers.parallel.context import ParallelContext
from framework.models.loaded import LoadedModel
from framework.models.setup import read_model_config
from framework.params.kv_groups import KVGroupLayout
from framework.params.scheduler_output import SchedulerOutput
from framework.runner.async_output import AsyncOutput
from framework.runner.interface import ModelRunner
from framework.runner.model_runner import ModelRunnerV2
from framework.runner.observer import StepObserver

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0


def spawn_workers(config: Mrv2Config, driver_rank: int, port: int) -> list[Any]:
    """Start one process per rank other than `driver_rank`; each runs `framework.executor.worker.worker_main`.

    A worker gets the config as its JSON text and its place as plain numbers and a string, which it validates
    again: no object of ours crosses multiprocessing's pickle pipe.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    config_json = config.model_dump_json()
    procs = []
    for rank in range(config.parallel.world_size):
        if rank == driver_rank:
            continue
        proc = ctx.Process(
            target=worker_main,
            args=(config_json, rank, rank, f"tcp://127.0.0.1:{port}"),
            name=f"mrv2-rank{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


class _Workers:
    """The spawned worker processes (none under torchrun) and the groups; `close` ends them once."""

    def __init__(
        self, ctx: ParallelContext, procs: list[Any], cuda_device: Optional[int], send_timeout_s: float
    ) -> None:
        self.ctx, self.procs, self.closed = ctx, procs, False
        self.cuda_device = cuda_device  # the caller's current CUDA device, made current again by `close`
        self.send_timeout = timedelta(seconds=send_timeout_s)  # parallel.timeout_s: one command's delivery

    def send(self, command: Command) -> None:
        """Deliver `command` to every rank; raises if a spawned rank has exited or the delivery times out.

        The exit check comes first because gloo may not have noticed a dead peer yet: its send then waits for a
        receive that never comes, up to `send_timeout` (which still bounds a rank that hangs).
        """
        gone = [f"{proc.name} exited with code {proc.exitcode}" for proc in self.procs if not proc.is_alive()]
        if gone:
            raise ConnectionError(", ".join(gone))
        self.ctx.broadcast_bytes(encode_command(command), timeout=self.send_timeout)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.send(Command("shutdown"))
            self.ctx.meet(SHUTDOWN_MEET)  # every rank has read the command before any leaves the groups
        except Exception as err:  # a rank already gone: nothing to tell it, or it never comes to the meeting
            logger.warning("mrv2: could not tell every rank to shut down, or not meet them all: %s", err)
        # Leave the groups before waiting for the workers: NCCL tears a communicator down collectively, so a
        # worker's `destroy_process_group` blocks until the driver's runs too (joining first deadlocked on 2 GPUs).
        leave_groups()
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("mrv2: %s did not stop within %.0f s; terminating it", proc.name, JOIN_TIMEOUT_S)
                proc.terminate()
                proc.join(JOIN_TIMEOUT_S)
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)


def _shut_down(local: ModelRunnerV2, workers: _Workers) -> None:
    local.shutdown()  # graphs first, as on the workers: no graph may hold the communicators being torn down
    workers.close()


class DriverRunner(ModelRunner):
    """The engine's runner on the driver rank: broadcast each call to the workers, then run it here."""

    def __init__(self, local: ModelRunnerV2, workers: _Workers) -> None:
        self.local, self.ctx, self._workers = local, workers.ctx, workers
        self.name = local.name
        self._finalizer = weakref.finalize(self, _shut_down, local, workers)

    def __getattr__(self, name: str) -> Any:  # model, request_state, ... of the local runner (tests, benches)
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def kv_groups(self) -> Optional[KVGroupLayout]:  # the class default (None) would hide the local runner's
        """The local runner's KV groups: the engine's KV cache manager hands out one block id per group from them,
        and every rank's runner chose the same (same config, same layers)."""
        return self.local.kv_groups

    @property
    def num_draft_kv_layers(self) -> int:  # as `kv_groups`: the class default (0) would hide the local runner's
        """Paged KV layers the local runner's speculator adds (the engine sizes the KV blocks with them)."""
        return self.local.num_draft_kv_layers

    @property
    def step_events(self) -> Optional[list]:
        return self.local.step_events

    @step_events.setter
    def step_events(self, value: Optional[list]) -> None:
        self.local.step_events = value

    def set_observer(self, observer: StepObserver) -> None:
        """The local runner's graphs call the hooks (the driver's counts stand for every rank: they run the same
        steps)."""
        self.local.set_observer(observer)

    def _send(self, command: Command) -> None:
        try:
            self._workers.send(command)
        except Exception as err:
            raise RuntimeError(
                f"a parallel rank is gone ({type(err).__name__}: {err}); the parallel engine cannot "
                "continue: build a new one"
            ) from err

    def determine_num_kv_blocks(self) -> int:
        self._send(Command("kv_blocks"))
        return self.local.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._send(Command("init_kv", num_blocks))
        self.local.initialize_kv_cache(num_blocks)

    def capture_cuda_graphs(self) -> None:
        self._send(Command("graphs"))
        self.local.capture_cuda_graphs()

    def execute_model(self, output: SchedulerOutput) -> None:
        self._send(Command("step", output))  # workers run execute_model and sample_tokens on it
        self.local.execute_model(output)

    def sample_tokens(self) -> AsyncOutput:
        return self.local.sample_tokens()

    def shutdown(self) -> None:
        """Stop the workers and leave the process groups (also runs when the runner is garbage-collected)."""
        self._finalizer()


def start_parallel(config: Mrv2Config) -> tuple[LoadedModel, DriverRunner]:
    """Start every rank (spawned here, or joined under torchrun) and return the driver's model and runner.

    Under torchrun a process that is not the driver serves the driver here and then exits (`SystemExit(0)`).
    """
    check_parallel_config(config, read_model_config(config))
    place = torchrun_place(config)
    pp, tp = config.parallel.pipeline_parallel_size, config.parallel.tensor_parallel_size
    driver_rank = (pp - 1) * tp
    procs: list[Any] = []
    if place is None:
        port = config.parallel.master_port or free_port()
        place = RankPlace(driver_rank, driver_rank, f"tcp://127.0.0.1:{port}")
        procs = spawn_workers(config, driver_rank, port)
    caller_device = torch.cuda.current_device() if torch.cuda.is_available() else None
    device = rank_device(config, place.local_rank)
    try:
        ctx = init_groups(config, place, device)
    except Exception as err:
        for proc in procs:
            proc.terminate()
        raise ConfigError(f"parallel start-up failed: the ranks did not meet ({type(err).__name__}: {err})") from None
    workers = _Workers(ctx, procs, caller_device, config.parallel.timeout_s)
    if not ctx.is_driver:  # a torchrun rank: serve until the driver shuts down, then leave
        try:
            _, runner = build_rank(config, ctx, device)
            serve(runner, ctx)
        finally:
            leave_groups()
        raise SystemExit(0)
    try:
        loaded, local = build_rank(config, ctx, device)
    except BaseException:
        workers.close()
        raise
    logger.info(
        "mrv2: driver rank %d of %d (tensor parallel %d x pipeline parallel %d) on %s",
        ctx.rank,
        ctx.world_size,
        tp,
        pp,
        device,
    )
    return loaded, DriverRunner(local, workers)


__all__ = ["DriverRunner", "start_parallel"]
