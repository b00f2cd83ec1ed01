"""One engine step with CUDA's sync debug mode set to "error", for the GPU tests' no-host-sync checks."""

from __future__ import annotations

import torch

from framework.scheduler_output import SchedulerOutput


def step_without_host_sync(engine, so: SchedulerOutput | None = None) -> SchedulerOutput:  # type: ignore[no-untyped-def]
    """Schedule (unless `so` is given), execute and sample one step; any host sync inside raises.

    Reading the output back (`future.get()`) and the scheduler update happen after, outside the check: that is
    where the engine is meant to wait for the device.
    """
    so = engine.scheduler.schedule() if so is None else so
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.runner.execute_model(so)
        future = engine.runner.sample_tokens()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine.scheduler.update_from_output(so, future.get().sampled_token_ids)
    return so
