"""Shared set-up of the GPU test modules (each is skipped without CUDA by its own `pytestmark`)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Engines of earlier tests must not count against the next one's gpu_memory_utilization."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True, scope="session")
def _one_share_of_the_gpu_per_xdist_worker() -> Iterator[None]:
    """Under pytest-xdist, W workers share one GPU. Engines size their KV cache from `torch.cuda.mem_get_info`,
    which counts the other workers' memory as used, so one worker's engine could leave the next 0 blocks. Each
    worker sees 1/W of the card instead, with only its own memory in use."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or not torch.cuda.is_available():
        yield
        return
    real = torch.cuda.mem_get_info

    def share(device=None):  # type: ignore[no-untyped-def]
        total = real(device)[1] // workers
        return max(total - torch.cuda.memory_reserved(device), 0), total

    torch.cuda.mem_get_info = share
    try:
        yield
    finally:
        torch.cuda.mem_get_info = real
