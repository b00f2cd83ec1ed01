"""Shared fixtures: the embedded tiny model on the CPU, small enough for every test to build its own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Without a GPU, Triton kernels run in Triton's interpreter. The flag is read when a kernel is decorated, i.e.
# when framework modules are imported, so it must be set here, before any test module imports them.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def tiny_llm_factory():
    """Build `LLM("tiny", device="cpu", ...)` with overrides."""
    from framework import LLM

    def make(**kwargs):
        kwargs.setdefault("device", "cpu")
        return LLM("tiny", **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_llm():
    from framework import LLM

    return LLM("tiny", device="cpu")


def python_exe() -> str:
    return sys.executable
