"""Tensor and pipeline parallelism, the layer above the runner: launch, the driver and its workers.

One process per rank. The driver (last pipeline stage, tensor rank 0) owns the scheduler; it sends each step's
`SchedulerOutput` to every rank, and all ranks apply the same slot updates, so their request state stays
identical. What the model layers need (their rank, groups and collectives) is `framework.layers.parallel.context`, below
the runner; nothing under `framework/models/` imports this package. See the Parallelism page of the docs.
"""
