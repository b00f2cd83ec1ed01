"""The `parallel` section: tensor, pipeline and data parallelism (docs/parallelism.md, docs/scaling-out.md)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from framework.config.base import StrictModel


class ParallelConfig(StrictModel):
    """Tensor and pipeline parallelism over torch.distributed (see the Parallelism page)."""

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks that split every layer (heads, MLP, vocabulary); attention heads and KV heads "
        "must divide by it.",
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Ranks that split the layer stack into consecutive stages; at most the number of layers."
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend of the step's collectives; auto = nccl on GPUs, gloo on CPUs."
    )
    timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="How long a collective waits for a rank before the run fails (start-up, steps and the "
        "driver's delivery of each command to the other ranks).",
    )
    master_port: Optional[int] = Field(
        None, ge=1, le=65535, description="Port of the rendezvous when mrv2 spawns its ranks; null = a free port."
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="`mrv2 serve`: engine-core processes behind the one API server (one device and KV pool "
        "each), balanced by queue length and prefix-cache locality.",
    )
    data_parallel_locality_slack: int = Field(
        8,
        ge=0,
        description="Data parallel: a request may go to a rank holding more of its prefix while that rank has at "
        "most this many more requests in flight than the least loaded one.",
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
