"""The bench's observer on a test's engine: what its graphs replayed (`BenchCounters`)."""

from __future__ import annotations

from typing import Any

from framework.entrypoints.bench.counters import BenchCounters


def counted(llm: Any) -> BenchCounters:
    """The `BenchCounters` observing `llm.engine` (an `LLM`, or anything with an `engine`), attached on the first
    call: call it before the steps to count."""
    observer = llm.engine.observer
    if not isinstance(observer, BenchCounters):
        observer = BenchCounters()
        llm.engine.set_observer(observer)
    return observer
