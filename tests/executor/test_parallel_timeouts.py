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
