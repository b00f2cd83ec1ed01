"""One engine step with CUDA's sync debug mode set to "error", for the GPU tests' no-host-sync checks."""

from __future__ import annotations

import torch

from framework.params.scheduler_output import SchedulerOutput

DEVICE_BUSY_CYCLES = 1_000_000_000  # ~0.5 s of a spinning kernel at ~2 GHz: longer than queueing any step


def step_without_host_sync(engine, so: SchedulerOutput | None = None) -> SchedulerOutput:  # type: ignore[no-untyped-def]
    """Schedule (unless `so` is given), execute and sample one step; any host sync inside raises.

    The device is kept busy (a spinning kernel) while the step is queued: if the host waited for it anywhere,
    the busy period is over by the time the step returns, and the check fails.

    Reading the output back (`future.get()`) and the scheduler update happen after, outside the check: that is
    where the engine is meant to wait for the device.
    """
    so = engine.scheduler.schedule() if so is None else so
    # The sync debug mode misses some waits (a copy into a strided slice of pinned memory, for one): the device
    # is also kept busy for a while before the step, and must still be busy once the step is queued.
    from framework.entrypoints.bench.triton_compiles import compiled_variants, new_variants

    busy = torch.cuda.Event()
    torch.cuda._sleep(DEVICE_BUSY_CYCLES)
    busy.record()
    compiled = compiled_variants()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.runner.execute_model(so)
        future = engine.runner.sample_tokens()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # A Triton kernel compiled (and loaded) inside the step also waits for the device: name it, so a warm-up
    # that missed a variant is told apart from a sync on the step path.
    assert not busy.query(), (
        "the host waited for the device while queueing the step; Triton variants compiled "
        f"in the step: {new_variants(compiled, compiled_variants()) or 'none'}"
    )
    engine.scheduler.update_from_output(so, future.get().sampled_token_ids)
    return so
