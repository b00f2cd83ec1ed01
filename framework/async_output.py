"""Device-to-host copy of one step's sampled tokens, started on a side stream before the post-update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per batch row: the tokens the request produced this step (empty for a prefill chunk)."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]


class AsyncOutput:
    """Holds a step's results while they travel to the host; `get()` waits only for that copy.

    On a GPU the copy runs on `copy_stream` after the main stream reaches this point, into pinned memory,
    so the main stream goes on with the post-update and draft proposal. On the CPU the tensors are read as is.
    """

    def __init__(
        self,
        request_ids: list[str],
        sampled: torch.Tensor,  # [R, K+1] int64
        num_sampled: torch.Tensor,  # [R] int32
        copy_stream: Optional[torch.cuda.Stream] = None,
        host_buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # pinned [>=R, >=K+1], [>=R]
    ) -> None:
        self.request_ids = request_ids
        self._event: Optional[torch.cuda.Event] = None
        if copy_stream is None:
            self._sampled, self._num_sampled = sampled, num_sampled
            return
        main = torch.cuda.current_stream()
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(main)
            if host_buffers is None:
                host_buffers = (torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True),
                                torch.empty(num_sampled.shape, dtype=num_sampled.dtype, pin_memory=True))
            rows, width = sampled.shape
            self._sampled = host_buffers[0][:rows, :width]
            self._num_sampled = host_buffers[1][:rows]
            self._sampled.copy_(sampled, non_blocking=True)
            self._num_sampled.copy_(num_sampled, non_blocking=True)
            sampled.record_stream(copy_stream)
            num_sampled.record_stream(copy_stream)
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)

    @classmethod
    def empty(cls) -> "AsyncOutput":
        return cls([], torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int32))

    def get(self) -> ModelRunnerOutput:
        """Wait for the copy (GPU) and return plain Python lists."""
        if self._event is not None:
            self._event.synchronize()
        counts = self._num_sampled.tolist()
        rows = self._sampled.tolist()
        return ModelRunnerOutput(self.request_ids, [row[:n] for row, n in zip(rows, counts)])
