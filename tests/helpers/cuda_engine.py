"""An engine for a GPU test that frees its card on exit: the next engine of the same test (another TP size, the
one-GPU reference) starts with the memory back in the pool."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


@contextmanager
def freed_llm(path: Path, **kwargs: Any) -> Iterator[Any]:
    """`LLM(str(path), **kwargs)`, shut down (workers included) and its CUDA memory released when the block ends."""
    from framework import LLM

    llm = LLM(str(path), **kwargs)
    try:
        yield llm
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
