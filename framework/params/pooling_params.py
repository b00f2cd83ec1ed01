"""Parameters of an embedding (pooling) request, and what it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from framework.params.sampling_params import InvalidRequestError, SamplingParams

POOLING_TYPES = ("last", "mean", "cls")
# What an embedding request carries for the scheduler: one greedy step whose token is dropped. The scheduler
# never decodes it (`Request.pooling_params` is set), and it finishes with status "pooled" at its prompt's end.
POOLING_SAMPLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)


@dataclass
class PoolingParams:
    """How one prompt's hidden states (after the model's final norm) become one vector.

    - `pooling_type`: "last" (the last prompt token), "mean" (average over every prompt token) or "cls" (the
      first token); None = the model's default (`model.pooling` in the config).
    - `dimensions`: keep only the first `dimensions` values (Matryoshka-style), before normalising.
    - `normalize`: divide the (truncated) vector by its L2 norm.
    """

    pooling_type: Optional[str] = None
    normalize: bool = True
    dimensions: Optional[int] = None

    def validate(self, hidden_size: int) -> None:
        """Raise `InvalidRequestError` naming the offending field."""
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"PoolingParams.pooling_type={self.pooling_type!r}: unknown pooling type; "
                f"allowed: {', '.join(POOLING_TYPES)}"
            )
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"PoolingParams.normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None:
            if not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 1:
                raise InvalidRequestError(f"PoolingParams.dimensions must be a positive int, got {self.dimensions!r}")
            if self.dimensions > hidden_size:
                raise InvalidRequestError(
                    f"PoolingParams.dimensions={self.dimensions} exceeds the model's hidden size {hidden_size}"
                )


@dataclass
class PoolingRequestOutput:
    """What `LLM.encode` returns per input: one vector (`embedding`, a list of floats) per prompt.

    `finish_reason` is "pooled" once the vector is there ("abort" or "error" otherwise).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    embedding: list[float]
    finished: bool = True
    finish_reason: Optional[str] = "pooled"
    num_preemptions: int = 0
    error: Optional[str] = None


EmbeddingOutput = PoolingRequestOutput
