"""A request as the scheduler sees it, and what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from framework.params.encoder_input import EncoderInput
from framework.params.lora_request import LoRARequest
from framework.params.pooling_params import PoolingParams
from framework.params.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life; every request ends exactly once (finished or aborted)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_POOLED = "pooled"  # an embedding request whose prompt was computed and pooled

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
            RequestStatus.FINISHED_POOLED,
        )


@dataclass(eq=False)
class Request:
    """One generation request: prompt, sampling parameters and the tokens produced so far.

    Compares (and hashes) by identity: the scheduler finds requests in its queues with `is`, not by comparing
    every field of every request it passes (which made each removal from `running` cost O(R) field compares).
    """

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
    num_output_placeholders: int = 0  # tokens being sampled whose values the host has not seen yet (most)
    num_drafts_ready: int = 0  # drafts its slot holds for the next step (speculative decoding)
    num_preemptions: int = 0
    stop_token_id: Optional[int] = None
    stop_string: Optional[str] = None  # the stop string that ended it (set by the output processor)
    error: Optional[str] = None  # why it finished with status FINISHED_ERROR
    # Set for an embedding request: prefill only, finished ("pooled") when the prompt is computed.
    pooling_params: Optional[PoolingParams] = None
    # Set for an encoder-decoder (Whisper) request: the encoder runs on it in the request's first step.
    encoder_input: Optional[EncoderInput] = None
    lora: Optional[LoRARequest] = None  # its LoRA adapter (None: the base model)
    # Prefix caching (docs/prefix-caching.md): hashes of the full blocks of prompt + output so far, extended as
    # blocks fill; and what else changes this request's KV (an encoder input's hash, a LoRA name), mixed into
    # every block hash so that requests differing in them never share blocks.
    block_hashes: list[bytes] = field(default_factory=list)
    cache_extra_keys: tuple[Union[str, bytes, int], ...] = ()
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when it first ran
    # Set by `Scheduler.add_request` from the params and max_model_len, so that a step's stop check reads two
    # fields: the tokens that end it once min_tokens are out (eos unless ignored, stop_token_ids), and the
    # output length at which it ends (max_tokens, or max_model_len reached).
    stop_token_set: frozenset[int] = frozenset()
    max_output_len: int = 0

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
class Logprob:
    """The logprob of one token at one position, its rank (1 = most likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


SampleLogprobs = list[dict[int, Logprob]]  # per output token: sampled token and the top-k
PromptLogprobs = list[Optional[dict[int, Logprob]]]  # per prompt token; the first is None


@dataclass
class RequestMetrics:
    """Host timestamps of one request (`time.perf_counter()` seconds): when it arrived and when its first output
    token reached the host (None before that). Time to first token = `first_token_time - arrival_time`."""

    arrival_time: float
    first_token_time: Optional[float] = None

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's name): `RequestOutput.outputs` holds `n` of them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: Optional[float] = None
    # `LLM.chat` with tools or a reasoning parser: OpenAI `tool_calls` parsed out of `text`, and the reasoning
    # split from it (`text` is then the answer's content).
    tool_calls: Optional[list[dict[str, Any]]] = None
    reasoning_content: Optional[str] = None
    reasoning_tokens: Optional[int] = None  # output tokens of the thinking section (with a reasoning parser)


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per request (and `EngineCore.step` per finished or streamed request).

    For `output_kind="delta"`, `token_ids`, `text` and `logprobs` hold only what is new since the request's
    previous output; otherwise everything so far. `prompt_logprobs` appear once the prompt is done (in a
    delta stream: once). `cumulative_logprob` is the sum of the sampled tokens' logprobs (None unless
    `logprobs` was asked for).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: Union[int, str, None] = None  # the stop token id or stop string that ended it, if any
    num_preemptions: int = 0
    logprobs: Optional[SampleLogprobs] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    cumulative_logprob: Optional[float] = None
    error: Optional[str] = None  # set when finish_reason is "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed
    metrics: Optional[RequestMetrics] = None
    index: int = 0  # which of the request's `n` sequences this output is (streams interleave them)
    sequences: Optional[list[CompletionOutput]] = None  # every sequence, in index order, once all finished (n > 1)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The request's sequences, in index order, like vLLM's `RequestOutput.outputs` (one unless n > 1)."""
        if self.sequences is not None:
            return self.sequences
        return [
            CompletionOutput(
                self.index,
                self.text,
                self.token_ids,
                self.finish_reason,
                self.stop_reason,
                self.logprobs,
                self.cumulative_logprob,
            )
        ]
