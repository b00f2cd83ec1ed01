"""The interface every model runner implements (V2 now; the V1 fallback later)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from framework.async_output import AsyncOutput
from framework.scheduler_output import SchedulerOutput


class ModelRunner(ABC):
    """Turns a `SchedulerOutput` into one forward pass and its sampled tokens.

    The step is split in two so that pipeline-parallel ranks and async scheduling can interleave:
    `execute_model` updates per-request state, prepares inputs and runs the forward; `sample_tokens` samples,
    starts the copy of the results to the host and advances state. `AsyncOutput.get()` waits for the copy.
    """

    name: str

    @abstractmethod
    def profile_run(self) -> int:
        """Run a worst-case step on dummy requests; returns the peak activation bytes (0 on the CPU)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache."""

    def capture_cuda_graphs(self) -> None:
        """Capture CUDA graphs once the KV cache exists (runners without graphs do nothing)."""

    @abstractmethod
    def execute_model(self, output: SchedulerOutput) -> None: ...

    @abstractmethod
    def sample_tokens(self) -> AsyncOutput: ...
