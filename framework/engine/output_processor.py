"""Turning a step's sampled tokens into `RequestOutput`s: logprobs, text, stop strings, streaming deltas.

Runs on the host after `Scheduler.update_from_output` has appended the tokens and applied the token-level
stop conditions (eos, stop_token_ids, max_tokens, errors). Stop strings need the text, so they are checked
here, and a request they end is finished through the scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

from framework.engine.detokenizer import IncrementalDetokenizer, make_decode, stop_string_hit, untold_stop_tokens
from framework.engine.request import (
    Logprob,
    PromptLogprobs,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    SampleLogprobs,
)
from framework.engine.scheduler.scheduler import Scheduler
from framework.params.pooling_params import PoolingRequestOutput
from framework.runner.async_output import LogprobsLists, ModelRunnerOutput


@dataclass
class _OutputState:
    """Host-side output bookkeeping of one request."""

    request: Request
    detokenizer: Optional[IncrementalDetokenizer]
    logprobs: Optional[SampleLogprobs]
    cumulative_logprob: Optional[float]
    prompt_logprobs: Optional[PromptLogprobs]
    num_prompt_logprobs_missing: int = 0
    num_tokens_seen: int = 0  # output tokens already turned into text/logprobs
    # What the last streamed output covered (delta mode).
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_prompt_logprobs: bool = False
    embedding: Optional[list[float]] = None  # an embedding request's vector, once its prompt is pooled
    metrics: Optional[RequestMetrics] = None  # arrival and first-token times (host clock)
    # Emits nothing until it ends and needs no text on the way (final_only, no stop strings, no logprobs): once
    # its first token is timed, its running steps are skipped; its text is decoded once when it finishes.
    quiet: bool = False


class OutputProcessor:
    """Per-request detokenizer, logprobs and stream offsets, keyed by request id."""

    def __init__(self, tokenizer: Any, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._states: dict[str, _OutputState] = {}
        # Quiet requests whose first token is timed and that had not ended when last looked at: `process` skips
        # their rows while it is told what ended.
        self._quiet_running: set[str] = set()
        # `make_decode` per skip_special_tokens value, made once: it inspects the tokenizer's decode signature.
        self._decoders: dict[bool, Callable[[Sequence[int]], str]] = {}

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        detok = None
        if params.detokenize and self.tokenizer is not None:
            skip = params.skip_special_tokens
            decode = self._decoders.get(skip)
            if decode is None:
                decode = self._decoders[skip] = make_decode(self.tokenizer, skip)
            detok = IncrementalDetokenizer(self.tokenizer, skip, decode)
        prompt_lp = None
        if params.prompt_logprobs is not None:
            prompt_lp = [None] * request.num_prompt_tokens
        self._states[request.request_id] = _OutputState(
            request=request,
            detokenizer=detok,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            prompt_logprobs=prompt_lp,
            num_prompt_logprobs_missing=max(request.num_prompt_tokens - 1, 0) if prompt_lp is not None else 0,
            metrics=RequestMetrics(arrival_time=time.perf_counter()),
            quiet=(
                params.output_kind == "final_only"
                and not params.stop
                and params.logprobs is None
                and params.prompt_logprobs is None
                and request.pooling_params is None
            ),
        )

    def process(
        self, runner_output: ModelRunnerOutput, finished: Optional[Sequence[Request]] = None
    ) -> list[RequestOutput | PoolingRequestOutput]:
        """Outputs of this step: every request that finished, and streamed requests that made progress.

        `finished`: every request that ended since the last call other than through `abort` (what
        `Scheduler.update_from_output` returned). With it, the rows of quiet requests still running are
        dropped in one set test each instead of being looked at; None looks at every row.
        """
        quiet = self._quiet_running
        if finished is not None and quiet:
            for request in finished:
                quiet.discard(request.request_id)
            rows: Iterable[tuple[int, str]] = [
                (row, request_id) for row, request_id in enumerate(runner_output.request_ids) if request_id not in quiet
            ]
        else:
            rows = enumerate(runner_output.request_ids)
        outputs = []
        for row, request_id in rows:
            state = self._states.get(request_id)
            if state is None:
                continue  # aborted earlier
            if state.quiet and not state.request.status.is_finished and state.num_tokens_seen:
                quiet.add(request_id)  # nothing to report before it ends (at batch 256 most rows of most steps)
                continue
            if request_id in runner_output.pooled:
                state.embedding = runner_output.pooled[request_id]
            if request_id in runner_output.prompt_logprobs:
                self._add_prompt_logprobs(state, *runner_output.prompt_logprobs[request_id])
            row_logprobs = runner_output.logprobs[row] if runner_output.logprobs is not None else None
            self._add_tokens(state, row_logprobs)
            if state.quiet and state.num_tokens_seen and not state.request.status.is_finished:
                quiet.add(request_id)  # its first token is timed: skipped from now until it ends
            output = self._make_output(state)
            if output is not None:
                outputs.append(output)
        return outputs

    def abort(self, request: Request) -> RequestOutput | PoolingRequestOutput:
        """The final output of an aborted request."""
        state = self._states.get(request.request_id)
        if state is None:
            self.add_request(request)
            state = self._states[request.request_id]
        output = self._make_output(state)
        assert output is not None
        return output

    # ---- per request ---------------------------------------------------------------------------------
    def _forget(self, request_id: str) -> None:
        """The request ended and its final output is made: drop its state."""
        self._states.pop(request_id, None)
        self._quiet_running.discard(request_id)

    def _add_prompt_logprobs(self, state: _OutputState, start: int, lists: LogprobsLists) -> None:
        if state.prompt_logprobs is None:
            return
        k = state.request.sampling_params.prompt_logprobs or 0
        for i in range(len(lists.ranks)):
            position = start + 1 + i  # the prompt token this entry scores
            if state.prompt_logprobs[position] is None:
                state.num_prompt_logprobs_missing -= 1
            state.prompt_logprobs[position] = self._logprob_entry(state, lists, i, k)

    def _logprob_entry(self, state: _OutputState, lists: LogprobsLists, i: int, k: int) -> dict[int, Logprob]:
        """{token: Logprob} for entry i: the chosen token (with its rank), then the top-k (rank = place)."""
        ids, values = lists.token_ids[i], lists.logprobs[i]
        decode = state.detokenizer.decode_one if state.detokenizer is not None else (lambda _: None)
        entry = {ids[0]: Logprob(values[0], lists.ranks[i], decode(ids[0]))}
        for place in range(1, min(k, len(ids) - 1) + 1):
            if ids[place] not in entry:
                entry[ids[place]] = Logprob(values[place], place, decode(ids[place]))
        return entry

    def _add_tokens(self, state: _OutputState, row_logprobs: Optional[LogprobsLists]) -> None:
        request = state.request
        params = request.sampling_params
        new_tokens = request.output_token_ids[state.num_tokens_seen :]
        if new_tokens and state.metrics is not None and state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.perf_counter()
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED
        untold = untold_stop_tokens(stopped_by_token, params.include_stop_str_in_output)
        # Text is needed while running only for stop strings and streaming; otherwise the output is decoded once
        # when the request finishes (one decode call instead of two per token: the host stays off the hot path).
        incremental = bool(params.stop) or params.output_kind != "final_only"
        for i, token in enumerate(new_tokens):
            if state.logprobs is not None and row_logprobs is not None and i < len(row_logprobs.ranks):
                state.logprobs.append(self._logprob_entry(state, row_logprobs, i, params.logprobs or 0))
                state.cumulative_logprob = (state.cumulative_logprob or 0.0) + row_logprobs.logprobs[i][0]
            if state.detokenizer is None or not incremental or i >= len(new_tokens) - untold:
                continue
            delta = state.detokenizer.append(token)
            num_output = state.num_tokens_seen + i + 1
            # Also in a step a stop token ended: a stop string completed by an earlier token of it (several tokens
            # a step under speculative decoding) ends the request there, as in vLLM.
            hit = stop_string_hit(state.detokenizer.text, params.stop, len(delta), num_output, params.min_tokens)
            if hit is not None:
                self._stop_at_string(state, hit, num_output)
                break
        state.num_tokens_seen = len(request.output_token_ids)
        if request.status.is_finished and state.detokenizer is not None and request.stop_string is None:
            if incremental:
                state.detokenizer.flush()
            else:
                state.detokenizer.decode_all(request.output_token_ids[: len(request.output_token_ids) - untold])

    def _stop_at_string(self, state: _OutputState, hit: tuple[str, int], num_output: int) -> None:
        stop, index = hit
        request = state.request
        detok = state.detokenizer
        assert detok is not None
        keep = index + len(stop) if request.sampling_params.include_stop_str_in_output else index
        detok.text = detok.text[:keep]
        del request.output_token_ids[num_output:]  # tokens after the one that completed the stop string
        if state.logprobs is not None:
            del state.logprobs[num_output:]
        request.stop_string = stop
        request.stop_token_id = None
        if request.status.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED  # it also hit max_tokens on this token
        else:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _pooling_output(self, state: _OutputState) -> Optional[PoolingRequestOutput]:
        """An embedding request has one output, when it finishes (its vector, or empty if aborted/failed)."""
        request = state.request
        if not request.status.is_finished:
            return None
        self._forget(request.request_id)
        return PoolingRequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            embedding=state.embedding or [],
            finished=True,
            finish_reason=request.status.value,
            num_preemptions=request.num_preemptions,
            error=request.error,
        )

    def _make_output(self, state: _OutputState) -> RequestOutput | PoolingRequestOutput | None:
        request = state.request
        if request.pooling_params is not None:
            return self._pooling_output(state)
        params = request.sampling_params
        finished = request.status.is_finished
        kind = params.output_kind
        if finished:
            self._forget(request.request_id)
        elif kind == "final_only" or len(request.output_token_ids) == state.sent_tokens:
            return None
        text = state.detokenizer.text if state.detokenizer is not None else ""
        if not finished and params.stop and not params.include_stop_str_in_output:
            text = text[: max(0, len(text) - (max(len(s) for s in params.stop) - 1))]  # a stop string may be growing
        prompt_done = state.prompt_logprobs is not None and state.num_prompt_logprobs_missing == 0
        prompt_logprobs = state.prompt_logprobs if prompt_done else None
        if kind == "delta":  # only what is new: copying the whole output every step would be quadratic
            token_ids = request.output_token_ids[state.sent_tokens :]
            logprobs = state.logprobs[state.sent_tokens :] if state.logprobs is not None else None
            text, sent_chars = text[state.sent_chars :], len(text)
            prompt_logprobs = None if state.sent_prompt_logprobs else prompt_logprobs
            state.sent_chars = sent_chars
            state.sent_prompt_logprobs = state.sent_prompt_logprobs or prompt_logprobs is not None
        else:
            token_ids = list(request.output_token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        state.sent_tokens = len(request.output_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=token_ids,
            text=text,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_string if request.stop_string is not None else request.stop_token_id,
            num_preemptions=request.num_preemptions,
            logprobs=logprobs,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
            cumulative_logprob=state.cumulative_logprob,
            error=request.error,
            num_cached_tokens=request.num_cached_tokens,
            metrics=state.metrics,
        )
