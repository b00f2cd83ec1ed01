"""Shared set-up of the GPU test modules (each is skipped without CUDA by its own `pytestmark`)."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Engines of earlier tests must not count against the next one's gpu_memory_utilization."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
