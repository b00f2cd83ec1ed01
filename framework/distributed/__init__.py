"""Tensor and pipeline parallelism over torch.distributed: process groups, launch, the driver and its workers.

One process per rank. The driver (last pipeline stage, tensor rank 0) owns the scheduler; it sends each step's
`SchedulerOutput` to every rank, and all ranks apply the same slot updates, so their request state stays
identical. See the Parallelism page of the docs.
"""

from framework.distributed.context import ParallelContext

__all__ = ["ParallelContext"]
