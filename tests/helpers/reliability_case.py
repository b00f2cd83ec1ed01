"""A case of the reliability catalogue (`helpers.reliability_catalogue`), and the tiny engine most cases use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from framework import (
    LLM,
)


@dataclass(frozen=True)
class Case:
    id: str
    area: str  # config | request | checkpoint | start-up
    bad_input: str  # what the user did, for the docs
    error: Optional[type]  # None: not an error (the documented result is in `message`)
    message: str  # a literal fragment of the message (or the documented result)
    trigger: Callable[[Any], Any]  # ctx -> raises (ctx.llm: a running LLM; ctx.ckpt: a checkpoint dir; ctx.tmp)
    engine_running: bool = False  # requests are in flight when it is triggered; they must not be disturbed


def tiny(**kwargs: Any) -> LLM:
    return LLM("random_tiny", device="cpu", **kwargs)
