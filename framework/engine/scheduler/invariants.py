"""The scheduler's leak check (`scheduler.check_invariants`, run after every step when configured)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from framework.engine.request import Request, RequestStatus
from framework.engine.scheduler.kv_cache_manager import KVCacheManager


def check_scheduler_invariants(
    kv_cache: KVCacheManager,
    waiting_queue: Iterable[Request],
    running_queue: Collection[Request],
    requests: Iterable[str],
    max_num_seqs: int,
) -> None:
    """Raise `AssertionError` on a leak: block pool conservation, each request in exactly one queue with a
    matching status, only running requests hold blocks. Takes the scheduler's parts, not the scheduler."""
    kv_cache.check_conservation()
    waiting_queue = list(waiting_queue)
    waiting = {r.request_id for r in waiting_queue}
    running = {r.request_id for r in running_queue}
    problems = []
    if waiting & running or waiting | running != set(requests) or len(running) != len(running_queue):
        problems.append("a request is in no queue, in both, or twice")
    if len(running_queue) > max_num_seqs:
        problems.append(f"{len(running_queue)} running requests > max_num_seqs={max_num_seqs}")
    if any(r.status != RequestStatus.RUNNING for r in running_queue):
        problems.append("a running request's status is not RUNNING")
    if any(r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting_queue):
        problems.append("a waiting request's status is not WAITING or PREEMPTED")
    if not kv_cache.holders() <= running:
        problems.append("blocks are held by a request that is not running (or has ended)")
    if problems:
        raise AssertionError("scheduler invariant broken: " + "; ".join(problems))
