"""One host-to-device copy per step for a step's small per-row arrays, from host buffers used in turn.

A step sends a few short int32 arrays (idx_mapping, prefix sums, per-row counts). Five separate copies cost
five driver calls; a non_blocking copy from pageable memory may also make the driver wait for the stream to
stage it. `InputStaging` packs them into one pinned host buffer (a GPU only: on the CPU there is nothing to
pin) and sends it in one non_blocking copy; the pieces are views of one device buffer.

A host buffer must not be rewritten while the copy that reads it may still be in flight, and a device buffer
must not be overwritten while a step may still read its views: `HostRing` keeps `num_buffers` of each, used
in turn, and before a host buffer is reused waits for the event recorded after its last copy (long done in
practice: the engine read that step's output, which the device produced after the copy).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import numpy as np
import torch

# Views start at multiples of 16 bytes: Triton specialises pointer arguments on 16-byte divisibility, so an
# unaligned view would compile a second variant of each kernel (and load less well).
_ALIGN = 4  # int32 elements


class Fence(Protocol):
    """What `HostRing` needs of a `torch.cuda.Event`: recorded after a copy, waited on before reuse."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


def _cuda_fence() -> Fence:
    return torch.cuda.Event()


class HostRing:
    """`num_buffers` int32 host buffers of `capacity` elements, used in turn; pinned when `device` is a GPU
    (unless `pin` is False: a pageable source, which the driver stages before the copy call returns).

    `take()` returns the next buffer once the copy that last read it has finished; `sent()` marks that a copy
    from it was just enqueued (on the current stream). `make_fence` replaces CUDA events (tests; none on
    the CPU or for pageable buffers, whose copies have read them when they return).
    """

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        num_buffers: int = 3,
        make_fence: Optional[Callable[[], Fence]] = None,
        pin: Optional[bool] = None,
    ) -> None:
        if num_buffers < 1 or capacity < 1:
            raise ValueError(f"HostRing needs num_buffers >= 1 and capacity >= 1, got {num_buffers}, {capacity}")
        pinned = device.type == "cuda" if pin is None else pin and device.type == "cuda"
        self.capacity = capacity
        self.buffers = [torch.empty(capacity, dtype=torch.int32, pin_memory=pinned) for _ in range(num_buffers)]
        self._arrays = [b.numpy() for b in self.buffers]  # numpy views: filled without per-element torch calls
        make = make_fence if make_fence is not None else (_cuda_fence if pinned else None)
        # One fence per buffer, made once and recorded again at each copy (no event created per step).
        self._fences: Optional[list[Fence]] = None if make is None else [make() for _ in range(num_buffers)]
        self._in_flight = [False] * num_buffers  # a copy from the buffer was recorded and not yet waited on
        self.turn = 0  # steps taken so far; buffer `turn % num_buffers` is the next

    def take(self) -> tuple[int, torch.Tensor, np.ndarray]:
        """(index, host tensor, its numpy view) of the next buffer, free to be written."""
        i = self.turn % len(self.buffers)
        self.turn += 1
        if self._fences is not None and self._in_flight[i]:
            self._fences[i].synchronize()
            self._in_flight[i] = False
        return i, self.buffers[i], self._arrays[i]

    def sent(self, index: int) -> None:
        """A copy from buffer `index` was enqueued: it is not rewritten before that copy finishes."""
        if self._fences is not None:
            self._fences[index].record()
            self._in_flight[index] = True


class InputStaging:
    """Packs a step's small arrays into one host buffer and sends them in one copy (see the module doc)."""

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        num_buffers: int = 3,
        make_fence: Optional[Callable[[], Fence]] = None,
        pin: Optional[bool] = None,
    ) -> None:
        self.ring = HostRing(capacity, device, num_buffers, make_fence, pin)
        self.device_buffers = [torch.empty(capacity, dtype=torch.int32, device=device) for _ in range(num_buffers)]
        self.copies = 0  # host-to-device copies sent (one per `send`)

    @staticmethod
    def capacity_for(max_rows: int, num_pieces: int) -> int:
        """Elements that `num_pieces` arrays of at most `max_rows + 1` each need, aligned."""
        return num_pieces * -(-(max_rows + 1) // _ALIGN) * _ALIGN

    def send(self, pieces: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """One int32 view on the device per 1-D piece (values cast to int32), all sent in one copy."""
        starts, end = [], 0
        for piece in pieces:
            starts.append(end)
            end += -(-len(piece) // _ALIGN) * _ALIGN
        if end > self.ring.capacity:
            raise ValueError(
                f"input staging holds {self.ring.capacity} int32 elements; this step's "
                f"{len(pieces)} arrays of lengths {[len(p) for p in pieces]} need {end}"
            )
        index, host, host_np = self.ring.take()
        for start, piece in zip(starts, pieces):
            host_np[start : start + len(piece)] = piece
        device = self.device_buffers[index]
        device[:end].copy_(host[:end], non_blocking=True)
        self.ring.sent(index)
        self.copies += 1
        return [device[start : start + len(piece)] for start, piece in zip(starts, pieces)]
