"""One HTTP generation request in flight: its prompts' engine requests, their sequences' text, its events.

A completion with several prompts and `n` sequences each is `len(prompts)` engine requests sharing one queue;
choice `p * n + i` is sequence i of prompt p. Whoever consumes `events()` and stops early (a client that
disconnected, a stream cancelled) leaves through its `finally`, which aborts everything still running, so no
slot or block outlives its client.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple, Optional

from framework.engine.parallel_sampling import child_request_id
from framework.entrypoints.serve.client_interface import ServingClient
from framework.entrypoints.serve.engine_client import RequestFailed, StreamItem
from framework.entrypoints.serve.errors import ApiError, ClientDisconnected
from framework.entrypoints.serve.metrics import ServerMetrics
from framework.entrypoints.serve.protocol import TokenLogprobs
from framework.entrypoints.serve.sequence_text import SequenceText
from framework.entrypoints.serve.stream_inbox import StreamInbox
from framework.params.lora_request import LoRARequest
from framework.params.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
NO_TOKEN_LEFT = "no token can be sampled"  # how the sampler's message for a row with every token excluded starts
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there


class SequenceEvent(NamedTuple):
    """What one choice gained: text and tokens (and their logprobs) since its previous event."""

    choice: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprobs]]
    finish_reason: Optional[str]  # "stop" | "length" | None while running
    stop_reason: Any = None


@dataclass
class _Sequence:
    text: SequenceText
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    num_sent_tokens: int = 0


class Generation:
    """The engine requests of one HTTP request and the text of each of their sequences."""

    def __init__(
        self,
        client: ServingClient,
        tokenizer: Any,
        metrics: ServerMetrics,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        stream: bool,
        log_requests: bool = False,
        field_names: Optional[dict[str, str]] = None,
        lora: Optional[LoRARequest] = None,
    ) -> None:
        """`field_names`: the engine's name of a field -> the request's (`params.engine_field_names`), so that an
        engine refusal names what the client sent. `lora`: the LoRA adapter the request's `model` selected."""
        self.client = client
        self.field_names = field_names or {}
        self.metrics = metrics
        self.request_id = request_id
        self.log_requests = log_requests
        self.params = params
        self.prompts = prompts
        self.arrival = time.perf_counter()
        self.first_token_time: Optional[float] = None
        self._disconnect_check = self.arrival + DISCONNECT_POLL_S  # when `_next` next asks the client
        self.num_cached_tokens = 0
        self.prompt_logprobs: dict[int, list[Optional[TokenLogprobs]]] = {}  # prompt index -> its logprobs
        self._engine_ids = [f"{request_id}-{p}" for p in range(len(prompts))]
        self._prompt_of = {engine_id: p for p, engine_id in enumerate(self._engine_ids)}
        self._sequences = [_Sequence(SequenceText(tokenizer, params, stream)) for _ in range(len(prompts) * params.n)]
        self._running = len(self._sequences)
        self.stream = stream
        self._inbox: StreamInbox[StreamItem] = StreamInbox()
        for engine_id, ids in zip(self._engine_ids, prompts):
            client.add(engine_id, ids, self._inbox, sampling_params=params, lora=lora)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.text.token_ids) for s in self._sequences)

    def sequence(self, choice: int) -> SequenceText:
        return self._sequences[choice].text

    async def _next(self, is_disconnected: Optional[Callable[[], Awaitable[bool]]]) -> list[StreamItem]:
        """The engine items that came since the last call (at least one). With `is_disconnected`, the client is
        checked every DISCONNECT_POLL_S whether or not items come meanwhile: a client that left a busy request
        would otherwise hold its slot to the end."""
        while True:
            if is_disconnected is not None and time.perf_counter() >= self._disconnect_check:
                self._disconnect_check = time.perf_counter() + DISCONNECT_POLL_S
                if await is_disconnected():
                    raise ClientDisconnected("the client disconnected")
            if is_disconnected is None:
                items = await self._inbox.take()
            else:
                items = await self._inbox.take(max(0.0, self._disconnect_check - time.perf_counter()))
            if items:
                return items

    async def events(
        self, is_disconnected: Optional[Callable[[], Awaitable[bool]]] = None, watch_until_first: bool = False
    ) -> AsyncIterator[list[SequenceEvent]]:
        """Batches of events until every sequence ends; raises `ApiError` if the engine refuses or fails it.

        Each wake-up takes every engine item already there. A stream (`stream=True`) gets one event per engine
        step per sequence, never one event for tokens of different steps: a consumer that fell behind sends
        the steps it missed as separate events in one write, and the reader still sees every step's tokens as
        that step's. Otherwise each wake-up gives one event per sequence that changed. `is_disconnected` is
        polled while waiting (only until the first batch with `watch_until_first`: a started stream learns of
        a disconnect from its HTTP response, which closes this generator)."""
        try:
            while self._running:
                items = await self._next(is_disconnected)
                if watch_until_first:
                    is_disconnected = None
                if self.stream:
                    yield [event for item in items for event in self._step_events(item)]
                    continue
                touched: dict[int, _Sequence] = {}
                for item in items:
                    self._apply(item, touched)
                yield [self._event(choice, seq) for choice, seq in touched.items()]
        finally:
            self._close()

    def _step_events(self, item: StreamItem) -> list[SequenceEvent]:
        """The event of one engine step's delta (none if it changed nothing)."""
        touched: dict[int, _Sequence] = {}
        self._apply(item, touched)
        if not touched:
            return []
        choice, seq = touched.popitem()
        return [self._event(choice, seq)]

    def _request_names(self, message: str) -> str:
        for engine_name, request_name in self.field_names.items():
            message = message.replace(engine_name, request_name)
        return message

    def _failed(self, error: Optional[str]) -> ApiError:
        """A 500 for a request the engine failed, but a 400 where the request's own min_tokens outlasted its grammar
        (validation refuses that up front when its walk over the grammar decides; see docs/tool_calling.md)."""
        so, min_tokens = self.params.structured_outputs, self.params.min_tokens
        if error and error.startswith(NO_TOKEN_LEFT) and so is not None and min_tokens > 0:
            return ApiError.invalid(
                self._request_names(
                    f"SamplingParams.structured_outputs.{so.kind} ended before SamplingParams.min_tokens="
                    f"{min_tokens} tokens, and min_tokens forbids ending sooner ({error}): lower min_tokens"
                )
            )
        return ApiError(500, error or "the engine failed this request")

    def _apply(self, item: StreamItem, touched: dict[int, _Sequence]) -> None:
        """One engine delta into its sequence's text; `touched` collects the sequences that changed."""
        if isinstance(item, RequestFailed):
            if item.kind != "invalid":
                raise ApiError(503, item.message)
            raise ApiError.invalid(self._request_names(item.message))
        n = self.params.n
        prompt = self._prompt_of[item.request_id]
        choice = prompt * n + item.index
        seq = self._sequences[choice]
        if seq.finish_reason is not None:
            return  # tokens of a sequence its stop string already ended
        if item.finish_reason == "error":
            raise self._failed(item.error)
        if item.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = item.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, item.num_cached_tokens)
        if item.token_ids and self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        # The engine core ends a sequence with "stop" only on a stop token (stop strings are matched here).
        if seq.text.add(item.token_ids, item.logprobs, stopped_by_token=item.finish_reason == "stop"):
            seq.finish_reason, seq.stop_reason = "stop", seq.text.stop_string
            self.client.abort([child_request_id(item.request_id, item.index, n)])
        elif item.finish_reason is not None:
            seq.text.finish()
            seq.finish_reason, seq.stop_reason = item.finish_reason, item.stop_reason
        if seq.finish_reason is not None:
            self._running -= 1
        touched[choice] = seq

    def _event(self, choice: int, seq: _Sequence) -> SequenceEvent:
        tokens = seq.text.token_ids[seq.num_sent_tokens :]
        logprobs = seq.text.logprobs[seq.num_sent_tokens :] if seq.text.logprobs is not None else None
        seq.num_sent_tokens = len(seq.text.token_ids)
        final = seq.finish_reason is not None
        return SequenceEvent(choice, seq.text.release(final), tokens, logprobs, seq.finish_reason, seq.stop_reason)

    def _close(self) -> None:
        """Abort what still runs in the engine, stop routing its outputs, record the request's metrics."""
        if self._running:
            self.client.abort(list(self._engine_ids))
        for engine_id in self._engine_ids:
            self.client.release(engine_id)
        reasons = [s.finish_reason or "abort" for s in self._sequences]
        end = time.perf_counter()
        self.metrics.observe_request(
            self.arrival, self.first_token_time, end, self.num_prompt_tokens, self.num_output_tokens, reasons[0]
        )
        if self.log_requests:
            logger.info(
                "mrv2 serve: %s prompts=%d n=%d prompt_tokens=%d output_tokens=%d finish=%s %.3fs",
                self.request_id,
                len(self.prompts),
                self.params.n,
                self.num_prompt_tokens,
                self.num_output_tokens,
                ",".join(sorted(set(reasons))),
                end - self.arrival,
            )
