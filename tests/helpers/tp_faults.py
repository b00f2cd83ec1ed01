"""Faults planted in every rank of a parallel run: the driver through monkeypatch, the spawned workers through
`worker_main_with_fault`, which `framework.executor.driver.spawn_workers` starts in their place.

A spawned worker imports mrv2 afresh, so a monkeypatch in the test process never reaches it; the worker target is
the one thing the driver hands over (by module and name), so the test swaps it for a function here that plants the
fault and then runs the real worker.
"""

from __future__ import annotations

import functools
from typing import Callable

import pytest


def _gpt_oss_down_bias_per_rank(setattr_: Callable[..., None]) -> None:
    """Every tensor rank adds gpt-oss's expert down bias (instead of rank 0 alone): the all-reduce sums it tp
    times."""
    from framework.layers.kernels.moe_epilogue import CLAMPED_SWIGLU, MoeEpilogue
    from framework.models.gpt_oss import GptOssExperts

    def every_rank(self):  # type: ignore[no-untyped-def]
        return MoeEpilogue(CLAMPED_SWIGLU, self.alpha, self.limit, self.gate_up_proj_bias, self.down_proj_bias)

    setattr_(GptOssExperts, "epilogue", every_rank)


def _row_parallel_bias_per_rank(setattr_: Callable[..., None]) -> None:
    """Every tensor rank adds a row-parallel layer's bias (o_proj) to its partial sum, before the all-reduce."""
    from torch.nn import functional as F

    from framework.layers.parallel.linear import RowParallelLinear

    def biased_partial(self, x):  # type: ignore[no-untyped-def]
        return self.ctx.tp_all_reduce(F.linear(x, self.weight, self.bias))

    setattr_(RowParallelLinear, "forward", biased_partial)


def _ungrouped_block_tables(setattr_: Callable[..., None]) -> None:
    """Every layer reads and writes group 0's (the full layers') block table, as one table without KV groups
    would, while the scheduler hands out and gives back blocks per group."""
    from dataclasses import replace

    from framework.models import llama

    def group0_only(meta, positions, layout):  # type: ignore[no-untyped-def]
        if layout is None:
            return (meta,)
        width = meta.block_tables.shape[1] // layout.num_groups
        return (replace(meta, block_tables=meta.block_tables[:, :width]),) * layout.num_groups

    setattr_(llama, "group_metadata", group0_only)


def _gemma_embedding_unscaled(setattr_: Callable[..., None]) -> None:
    """Gemma's token embedding without its sqrt(hidden) scale (the summed vocabulary-parallel lookup alone)."""
    from framework.layers.parallel.linear import VocabParallelEmbedding
    from framework.models.gemma3 import ScaledEmbedding

    setattr_(ScaledEmbedding, "forward", VocabParallelEmbedding.forward)


FAULTS: dict[str, Callable[[Callable[..., None]], None]] = {
    "gemma_embedding_unscaled": _gemma_embedding_unscaled,
    "gpt_oss_down_bias_per_rank": _gpt_oss_down_bias_per_rank,
    "row_parallel_bias_per_rank": _row_parallel_bias_per_rank,
    "ungrouped_block_tables": _ungrouped_block_tables,
}


def worker_main_with_fault(fault: str, config_json: str, rank: int, local_rank: int, init_method: str) -> None:
    """A spawned rank's entry point with `fault` planted first (runs in the worker process)."""
    from framework.executor import worker

    FAULTS[fault](setattr)
    worker.worker_main(config_json, rank, local_rank, init_method)


def plant_in_every_rank(mp: pytest.MonkeyPatch, fault: str) -> None:
    """Plant `fault` in this (driver) process and in every worker the driver spawns from now on."""
    FAULTS[fault](mp.setattr)
    plant_in_workers(mp, fault)


def plant_in_workers(mp: pytest.MonkeyPatch, fault: str) -> None:
    """Plant `fault` in every worker the driver spawns from now on, not in this (driver) process."""
    import framework.executor.driver as driver

    mp.setattr(driver, "worker_main", functools.partial(worker_main_with_fault, fault))
