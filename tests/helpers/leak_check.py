"""Leak checks any scheduler, block-pool or engine test can call: nothing queued, every block and slot free."""

from __future__ import annotations


def assert_no_leaks(scheduler, kv_cache=None) -> None:
    """All queues empty and every KV block back in the pool (plus the scheduler's own invariants)."""
    kv_cache = kv_cache if kv_cache is not None else scheduler.kv_cache
    scheduler.check_invariants()
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running, "requests left in the scheduler"
    assert kv_cache.num_free_blocks == kv_cache.num_blocks, (
        f"{kv_cache.num_blocks - kv_cache.num_free_blocks} KV blocks not returned to the pool"
    )


def runner_slots_in_use(runner) -> int:
    """Request slots the runner still holds (V2: RequestState; V1: persistent batch rows)."""
    if hasattr(runner, "request_state"):
        return runner.request_state.num_active
    return runner.batch.num_reqs


def assert_engine_drained(engine) -> None:
    """After every request ended: no leak in the scheduler or pool, and (after the step that tells the runner)
    no request slot held by the runner."""
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine.scheduler)
    engine.step()  # the runner frees the slots of requests that ended at its next step
    assert runner_slots_in_use(engine.runner) == 0, "the runner still holds request slots"
    assert_no_leaks(engine.scheduler)
