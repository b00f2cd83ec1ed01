"""The driver's command delivery is bounded: a rank that never takes a command fails the send, not the run.

A gloo send waits until the receiver posts its receive, and the command group's own limit is an idle engine's
(days). Two gloo ranks are built in this process on threads (a `HashStore`, no ports); rank 1 joins and then never
receives, like a hung or dead worker that gloo has not noticed.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from framework.layers.parallel.context import ParallelContext


def _two_gloo_ranks() -> list[dist.ProcessGroup]:
    store = dist.HashStore()
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(days=7))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(groups), "the two gloo ranks did not meet"
    return groups


def test_a_command_nobody_receives_fails_within_the_send_timeout() -> None:
    groups = _two_gloo_ranks()
    driver = ParallelContext(tp_size=2, rank=0, cpu_group=groups[0])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        driver.broadcast_bytes(b"step", timeout=timedelta(seconds=1))
    assert time.monotonic() - start < 20, "the send waited far past its timeout"


def test_the_shutdown_meeting_waits_for_every_rank_and_is_bounded() -> None:
    """`ParallelContext.meet`: the first rank to arrive waits for the other (it returns only after the second came),
    and a rank that never comes ends the wait within its timeout instead of holding the shutdown."""
    groups = _two_gloo_ranks()
    ranks = [ParallelContext(tp_size=2, rank=r, cpu_group=groups[r]) for r in range(2)]
    arrived: list[float] = []

    def late() -> None:
        time.sleep(1.0)
        arrived.append(time.monotonic())
        ranks[1].meet(timedelta(seconds=30))

    thread = threading.Thread(target=late)
    thread.start()
    ranks[0].meet(timedelta(seconds=30))
    left = time.monotonic()
    thread.join(30)
    assert arrived and left >= arrived[0], "rank 0 left the meeting before rank 1 arrived"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        ranks[0].meet(timedelta(seconds=1))  # rank 1 never comes
    assert time.monotonic() - start < 20, "the meeting waited far past its timeout"
