"""A request as the scheduler sees it, and what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from framework.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life; every request ends exactly once (finished or aborted)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """One generation request: prompt, sampling parameters and the tokens produced so far."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int] = None
    sampling_seed: int = 0  # params.seed, or drawn from the run seed on arrival
    prompt: Optional[str] = None
    arrival_index: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (reset to 0 by preemption)
    num_output_placeholders: int = 0  # tokens being sampled whose values the host has not seen yet
    num_preemptions: int = 0
    stop_token_id: Optional[int] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output: what a (re-)prefill must compute."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per request (and `EngineCore.step` per finished request)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[int] = None  # the stop token id that ended it, if any
    num_preemptions: int = 0
