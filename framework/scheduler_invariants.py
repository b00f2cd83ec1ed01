"""The scheduler's leak check (`scheduler.check_invariants`, run after every step when configured)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from framework.request import RequestStatus

if TYPE_CHECKING:
    from framework.scheduler import Scheduler


def check_scheduler_invariants(scheduler: "Scheduler") -> None:
    """Raise `AssertionError` on a leak: block pool conservation, each request in exactly one queue with a
    matching status, only running requests hold blocks."""
    scheduler.kv_cache.check_conservation()
    waiting = {r.request_id for r in scheduler.waiting}
    running = {r.request_id for r in scheduler.running}
    problems = []
    if waiting & running or waiting | running != set(scheduler.requests) or len(running) != len(scheduler.running):
        problems.append("a request is in no queue, in both, or twice")
    max_num_seqs = scheduler.config.max_num_seqs
    if len(scheduler.running) > max_num_seqs:
        problems.append(f"{len(scheduler.running)} running requests > max_num_seqs={max_num_seqs}")
    if any(r.status != RequestStatus.RUNNING for r in scheduler.running):
        problems.append("a running request's status is not RUNNING")
    if any(r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in scheduler.waiting):
        problems.append("a waiting request's status is not WAITING or PREEMPTED")
    if not scheduler.kv_cache.holders() <= running:
        problems.append("blocks are held by a request that is not running (or has ended)")
    if problems:
        raise AssertionError("scheduler invariant broken: " + "; ".join(problems))
