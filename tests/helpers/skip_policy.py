"""Which skips CI allows (`tests/conftest.py` enforces it under MRV2_CI=1, as `.ci/run` sets)."""

from __future__ import annotations

import re

GPU_ONLY_REASON = re.compile(r"\b(CUDA|GPUs?)\b")


def skip_is_allowed(nodeid: str, reason: str, cuda: bool) -> bool:
    """Only the GPU suite may skip, only for want of a GPU: a test under tests/gpu/ on a machine without CUDA,
    whose reason names CUDA or a GPU. Anything else (a missing optional dependency, a missing file, a module
    skipping itself) is a test that did not run."""
    return nodeid.startswith("tests/gpu/") and not cuda and GPU_ONLY_REASON.search(reason) is not None
