"""A stream beside the step's stream for KV copies: the step's stream waits for it on the device, the host never.

Work is submitted in parts (`submit` returns one ticket per part), and the step's stream can wait for one part
and everything before it (`wait_for`), or for everything (`wait`): a KV tier submits one part per paged layer
and the forward waits, layer by layer, only for the part it is about to read.

`CudaSideStream` runs submitted copies on a CUDA stream that first waits for the work already queued on the
step's stream (the KV it reads was written there), records an event after each part, and `wait_for` makes the
step's stream wait for that event (`wait_event`: a device-side dependency, no host sync). `DeferredSideStream`
is the CPU stand-in: it keeps the submitted parts and runs them, in order, only when the step's stream waits for
them, so a forward that reads a layer before waiting for it reads stale KV, as it would on a GPU, and the tests
see it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

Work = Callable[[], None]
Ticket = Union[int, "torch.cuda.Event"]  # what `wait_for` takes: a part's number (CPU) or its end event (CUDA)


class SideStream(ABC):
    """Runs KV copies asynchronously to the step; `finished_seconds` reports the timed batches that completed."""

    @abstractmethod
    def submit(self, parts: Sequence[Work], timed: bool = False) -> list[Ticket]:
        """Queue `parts` (each launches copies), in order, after everything already queued on the step's stream;
        one ticket per part. `timed`: the batch's duration, first part to last, is reported once it finished."""

    @abstractmethod
    def wait_for(self, ticket: Ticket) -> None:
        """The step's stream waits for the part of `ticket` and every part submitted before it (no host sync)."""

    @abstractmethod
    def wait(self) -> None:
        """The step's stream waits for every submitted part (no host sync)."""

    @abstractmethod
    def finished_seconds(self) -> list[float]:
        """Durations of the `timed` batches finished since the last call (never waits)."""


class CudaSideStream(SideStream):
    """A CUDA stream of its own; an event ends each part; timed batches are bracketed by timing events read once
    they completed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._timed: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def submit(self, parts: Sequence[Work], timed: bool = False) -> list[Ticket]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        tickets: list[Ticket] = []
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True) if timed else None
            if start is not None:
                start.record()
            for i, part in enumerate(parts):
                part()
                end = torch.cuda.Event(enable_timing=start is not None and i == len(parts) - 1)  # the batch's end
                end.record()
                tickets.append(end)
            if start is not None and tickets:
                self._timed.append((start, tickets[-1]))  # type: ignore[arg-type]
        return tickets

    def wait_for(self, ticket: Ticket) -> None:
        assert isinstance(ticket, torch.cuda.Event), f"a CUDA side stream's ticket is an event, not {ticket!r}"
        torch.cuda.current_stream(self.device).wait_event(ticket)

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def finished_seconds(self) -> list[float]:
        done = []
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.popleft()
            done.append(start.elapsed_time(end) / 1e3)
        return done


@dataclass
class _Timing:
    """A timed batch on the CPU stand-in: its parts not run yet, and the seconds of those that ran."""

    parts_left: int
    seconds: float = 0.0


class DeferredSideStream(SideStream):
    """The CPU stand-in: submitted parts run, in order, when the step's stream waits for them."""

    def __init__(self) -> None:
        self._queue: deque[tuple[int, Work, Optional[_Timing]]] = deque()
        self._next_ticket = 0
        self._seconds: list[float] = []

    def submit(self, parts: Sequence[Work], timed: bool = False) -> list[Ticket]:
        timing = _Timing(len(parts)) if timed and parts else None
        tickets: list[Ticket] = []
        for part in parts:
            self._queue.append((self._next_ticket, part, timing))
            tickets.append(self._next_ticket)
            self._next_ticket += 1
        return tickets

    def has_run(self, ticket: Ticket) -> bool:
        """Whether the part of `ticket` has run (its copies are in place)."""
        assert isinstance(ticket, int)
        return ticket < (self._queue[0][0] if self._queue else self._next_ticket)

    def wait_for(self, ticket: Ticket) -> None:
        assert isinstance(ticket, int), f"the CPU side stream's ticket is a part number, not {ticket!r}"
        while self._queue and self._queue[0][0] <= ticket:
            self._run_first()

    def wait(self) -> None:
        while self._queue:
            self._run_first()

    def _run_first(self) -> None:
        # Popped only after it ran: `has_run` is True once its copies are in place.
        _, work, timing = self._queue[0]
        start = time.perf_counter()
        work()
        self._queue.popleft()
        if timing is not None:
            timing.seconds += time.perf_counter() - start
            timing.parts_left -= 1
            if timing.parts_left == 0:
                self._seconds.append(timing.seconds)

    def finished_seconds(self) -> list[float]:
        done, self._seconds = self._seconds, []
        return done


def side_stream_for(device: torch.device) -> SideStream:
    """A CUDA side stream on a GPU, the deferred stand-in elsewhere."""
    return CudaSideStream(device) if device.type == "cuda" else DeferredSideStream()
