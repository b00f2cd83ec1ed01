"""Per-request sampling parameters, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


class InvalidRequestError(ValueError):
    """A request that cannot be served; the message names the offending field and its allowed range."""


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters. A request with a `seed`
    draws the same tokens whatever else is in the batch: the noise is keyed by (seed, token position).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first invalid field."""

        def bad(name: str, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: must be {allowed}")

        if self.n != 1:
            raise bad("n", "1 (parallel sampling is not supported yet)")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise bad("temperature", ">= 0 and finite (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "-1 or 0 (disabled) or a positive integer")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens < 1:
            raise bad("max_tokens", ">= 1")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise bad("min_tokens", "in [0, max_tokens]")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "None or >= 0")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", "in [-2, 2]")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", "in [-2, 2]")
        if not (self.repetition_penalty > 0.0):
            raise bad("repetition_penalty", "> 0")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "non-negative token ids")

    @property
    def is_greedy(self) -> bool:
        """True when the argmax is taken (temperature 0)."""
        return self.temperature == 0.0
