"""Shared set-up of the GPU test modules (each is skipped without CUDA by its own `pytestmark`)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

# The helpers beside the CPU tests (hf_models, whisper_models, ...) import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Engines of earlier tests must not count against the next one's gpu_memory_utilization."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
