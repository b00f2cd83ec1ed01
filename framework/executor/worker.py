"""A rank that is not the driver: build its part of the model, then run the driver's commands until shutdown.

The driver sends one command per call it makes on its runner (a msgpack `Command`, see `messages`, broadcast
as bytes on the gloo group); the worker makes the same call on its own runner, so both run the same collectives
in the same order. The
`step` command carries the step's `SchedulerOutput`: every rank applies the same slot updates and staged
writes, and advances by the driver's sampled tokens.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from datetime import timedelta
from typing import Optional

import torch

from framework.config.schema import ConfigError, Mrv2Config
from framework.executor.launch import RankPlace, init_groups, rank_device
from framework.executor.messages import decode_command
from framework.layers.parallel.context import ParallelContext
from framework.models.loaded import LoadedModel
from framework.models.setup import load_model
from framework.runner.model_runner import ModelRunnerV2

logger = logging.getLogger(__name__)


def build_rank(config: Mrv2Config, ctx: ParallelContext, device: torch.device) -> tuple[LoadedModel, ModelRunnerV2]:
    """Load this rank's part of the model and build its runner; every rank learns every rank's start-up error.

    Raises this rank's own error if it had one, else `ConfigError` naming the ranks that failed.
    """
    error: Optional[BaseException] = None
    loaded = runner = None
    try:
        loaded = load_model(config, device, ctx)
        runner = ModelRunnerV2(config, loaded)
    except Exception as err:  # every rank must reach the gather below, or the others wait for it
        error = err
    errors = ctx.gather_errors(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if errors:
        raise ConfigError("parallel start-up failed on " + "; ".join(errors))
    assert loaded is not None and runner is not None
    return loaded, runner


# How long a rank shutting down waits for the others at the meeting before leaving the groups (a rank that died
# never arrives: the wait ends and shutdown goes on).
SHUTDOWN_MEET = timedelta(seconds=60)


def serve(runner: ModelRunnerV2, ctx: ParallelContext) -> None:
    """Run the driver's commands on `runner` until it sends "shutdown"."""
    while True:
        command = decode_command(ctx.broadcast_bytes())  # CommandDecodeError on anything but a valid command
        if command.kind == "shutdown":
            runner.release_cuda_graphs()
            try:
                ctx.meet(SHUTDOWN_MEET)  # the driver meets here too before anyone leaves the groups
            except Exception as err:  # the driver is gone: leave anyway
                logger.warning("mrv2: the shutdown meeting did not complete: %s", err)
            return
        if command.kind == "step":
            runner.execute_model(command.payload)
            runner.sample_tokens()  # the driver reports; this rank only advances its slots
        elif command.kind == "kv_blocks":
            runner.determine_num_kv_blocks()
        elif command.kind == "init_kv":
            runner.initialize_kv_cache(command.payload)
        elif command.kind == "graphs":
            runner.capture_cuda_graphs()
        else:
            raise RuntimeError(f"unknown command from the driver: {command.kind!r}")


def run_worker(config: Mrv2Config, place: RankPlace) -> None:
    """Join the process groups, build this rank and serve the driver; leaves the groups at the end."""
    device = rank_device(config, place.local_rank)
    ctx = init_groups(config, place, device)
    try:
        _, runner = build_rank(config, ctx, device)
        serve(runner, ctx)
    finally:
        leave_groups()


def leave_groups(timeout_s: float = 20.0) -> bool:
    """`destroy_process_group` with a time limit; False if it did not finish.

    NCCL tears a communicator down collectively: when a peer is already gone (or never arrives) the call blocks
    forever. A rank that is shutting down must not hang on that, so the call runs on a daemon thread and is
    abandoned after `timeout_s` (the process exits soon after, which frees the communicator anyway).
    """
    import threading

    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=destroy, name="mrv2-leave-groups", daemon=True).start()
    if not done.wait(timeout_s):
        logger.warning("mrv2: leaving the process groups did not finish within %.0f s; going on without it", timeout_s)
        return False
    return True


def worker_main(config_json: str, rank: int, local_rank: int, init_method: str) -> None:
    """Entry point of a spawned rank (the config as `Mrv2Config` JSON, validated here): any failure is logged with
    the rank and ends the process non-zero."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"mrv2 rank {rank}: %(message)s")
    place = RankPlace(rank, local_rank, init_method)
    try:
        config = Mrv2Config.model_validate_json(config_json)
        if rank_device_type_is_cpu(config):  # ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel.world_size))
        run_worker(config, place)
    except BaseException as err:  # noqa: BLE001 - report and exit: the driver sees the rank leave
        detail = "" if isinstance(err, ConfigError) else "\n" + traceback.format_exc()  # start-up: driver says it
        print(f"mrv2: rank {place.rank} failed: {type(err).__name__}: {err}{detail}", file=sys.stderr)
        sys.exit(1)
    # The rank is done and has left its process groups: end without C++ static destructors, which can abort
    # ("terminate called without an active exception") while a gloo thread is still winding down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_device_type_is_cpu(config: Mrv2Config) -> bool:
    return config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
