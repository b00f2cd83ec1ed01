"""A stream beside the step's stream for KV copies: the step's stream waits for it on the device, the host never.

`CudaSideStream` runs submitted copies on a CUDA stream that first waits for the work already queued on the
step's stream (the KV it reads was written there), and `wait` makes the step's stream wait for the copies
(`wait_stream`: a device-side dependency, no host sync). `DeferredSideStream` is the CPU stand-in: it keeps the
submitted work and runs it only when `wait` is called, so a runner that forgot to wait reads stale KV, as it
would on a GPU, and the tests see it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from typing import Callable

import torch

Work = Callable[[], None]


class SideStream(ABC):
    """Runs KV copies asynchronously to the step; `finished_seconds` reports the timed batches that completed."""

    @abstractmethod
    def submit(self, work: Work, timed: bool = False) -> None:
        """Queue `work` (it launches copies) after everything already queued on the step's stream."""

    @abstractmethod
    def wait(self) -> None:
        """The step's stream waits for every submitted batch (no host sync)."""

    @abstractmethod
    def finished_seconds(self) -> list[float]:
        """Durations of the `timed` batches finished since the last call (never waits)."""


class CudaSideStream(SideStream):
    """A CUDA stream of its own; timed batches are bracketed by timing events read once they completed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._timed: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def submit(self, work: Work, timed: bool = False) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True) if timed else None
            if start is not None:
                start.record()
            work()
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._timed.append((start, end))

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def finished_seconds(self) -> list[float]:
        done = []
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.popleft()
            done.append(start.elapsed_time(end) / 1e3)
        return done


class DeferredSideStream(SideStream):
    """The CPU stand-in: submitted work runs, in order, when the step's stream waits."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Work, bool]] = deque()
        self._seconds: list[float] = []

    def submit(self, work: Work, timed: bool = False) -> None:
        self._queue.append((work, timed))

    def wait(self) -> None:
        while self._queue:
            work, timed = self._queue.popleft()
            start = time.perf_counter()
            work()
            if timed:
                self._seconds.append(time.perf_counter() - start)

    def finished_seconds(self) -> list[float]:
        done, self._seconds = self._seconds, []
        return done


def side_stream_for(device: torch.device) -> SideStream:
    """A CUDA side stream on a GPU, the deferred stand-in elsewhere."""
    return CudaSideStream(device) if device.type == "cuda" else DeferredSideStream()
