"""POST /v1/completions, /v1/chat/completions and /v1/embeddings.

Each handler validates the body into engine parameters, queues the prompts in the engine (`Generation`), then
either collects every event into one JSON body or streams them as server-sent events. A streamed request
waits for its first event before answering, so a request the engine refuses still gets its HTTP 400.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
import uuid
from typing import Any, Callable, Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel

from framework.entrypoints.chat_template import RENDER_ARGUMENTS
from framework.entrypoints.serve.chat_tools import chat_plan, finished, streamed
from framework.entrypoints.serve.engine_client import RequestFailed
from framework.entrypoints.serve.errors import ApiError, ClientDisconnected, loggable
from framework.entrypoints.serve.generation import Generation, SequenceEvent
from framework.entrypoints.serve.openai_models import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from framework.entrypoints.serve.params import (
    check_logprobs,
    check_model,
    engine_field_names,
    max_tokens_for,
    pooling_params,
    prompt_list,
    sampling_params,
    tokenize,
)
from framework.entrypoints.serve.responses import chat_logprobs, completion_logprobs, envelope, finite, usage
from framework.entrypoints.serve.state import ServerState
from framework.entrypoints.serve.stream_frames import CompletionFrames, sse_frame
from framework.entrypoints.serve.streaming import respond as _respond

router = APIRouter()
logger = logging.getLogger(__name__)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _warn_ignored(body: BaseModel, endpoint: str) -> None:
    """Name the body's fields this server does not read in a warning (as vLLM does), then go on without them."""
    if body.model_extra:
        names = ", ".join(loggable(name) for name in sorted(body.model_extra))
        logger.warning("%s: ignored fields not read by this server: %s", endpoint, names)


def _token_text(state: ServerState):  # type: ignore[no-untyped-def]
    tokenizer = state.tokenizer
    return (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer is not None else str


def _join(events: list[SequenceEvent]) -> tuple[str, list[int], list, Optional[str], Any]:
    text = "".join(e.text for e in events)
    tokens = [t for e in events for t in e.token_ids]
    logprobs = [lp for e in events for lp in (e.logprobs or [])]
    return text, tokens, logprobs, events[-1].finish_reason, events[-1].stop_reason


def _usage_tail(
    body: Any, head: dict[str, Any], gen: Generation, reasoning: Callable[[], Optional[int]] = lambda: None
) -> list[dict[str, Any]]:
    """The stream's last chunk before [DONE] when `stream_options.include_usage`: no choices, the usage."""
    if body.stream_options is None or not body.stream_options.include_usage:
        return []
    counts = usage(gen.num_prompt_tokens, gen.num_output_tokens, gen.num_cached_tokens, reasoning())
    return [{**head, "choices": [], "usage": counts}]


def _max_tokens(state: ServerState, requested: Optional[int], prompts: list[list[int]], field: str) -> int:
    return min(max_tokens_for(requested, len(p), state.max_model_len, field) for p in prompts)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = _state(request)
    lora = state.loras.select(body.model, state.model_name)  # a served LoRA adapter, or None (404 if unknown)
    _warn_ignored(body, "/v1/completions")
    if body.suffix:
        raise ApiError.invalid("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError.invalid(
            f"best_of={body.best_of} is not supported (only best_of equal to n, {body.n}): "
            "ask for n sequences and choose among them",
            "best_of",
        )
    raw = prompt_list(body.prompt, "prompt")
    prompts = [tokenize(state.tokenizer, p, "prompt", state.vocab_size) for p in raw]
    check_logprobs(state.max_logprobs, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)
    want_echo_logprobs = body.echo and body.logprobs is not None
    params = sampling_params(
        body,
        max_tokens=_max_tokens(state, body.max_tokens, prompts, "max_tokens"),
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if want_echo_logprobs else None,
    )
    state.check_capacity(len(prompts))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gen = Generation(
        state.client,
        state.tokenizer,
        state.metrics,
        request_id,
        prompts,
        params,
        body.stream,
        state.config.serve.log_requests,
        engine_field_names(body),
        lora=lora,
    )
    head = envelope("text_completion", request_id, state.model_name)
    text_of = _token_text(state)
    prompt_texts = [p if isinstance(p, str) else (state.tokenizer.decode(p) if state.tokenizer else "") for p in raw]
    echoed: set[int] = set()
    text_offsets: dict[int, int] = {}  # choice -> where its next token's text starts (a stream's chunks continue)

    def logprobs_of(choice: int, tokens: list[int], lps: list) -> Optional[dict[str, Any]]:
        if body.logprobs is None:
            return None
        prompt = choice // params.n
        if not body.echo or choice in echoed:
            out = completion_logprobs(tokens, lps, body.logprobs, text_of, text_offsets.get(choice, 0))
        else:
            prompt_lps = gen.prompt_logprobs.get(prompt, [None] * len(prompts[prompt]))
            out = completion_logprobs(prompts[prompt] + tokens, list(prompt_lps) + lps, body.logprobs, text_of)
        if out["tokens"]:
            text_offsets[choice] = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def prompt_logprobs_of(prompt: int) -> Optional[list]:
        """vLLM's format: per prompt token (the first is null), {token id: {logprob, rank, decoded_token}}."""
        if body.prompt_logprobs is None or prompt not in gen.prompt_logprobs:
            return None
        return [
            None
            if e is None
            else {str(t): {"logprob": finite(lp), "rank": rank, "decoded_token": text_of(t)} for t, lp, rank in e}
            for e in gen.prompt_logprobs[prompt]
        ]

    def echo(choice: int, text: str) -> str:
        if not body.echo or choice in echoed:
            return text
        return prompt_texts[choice // params.n] + text

    frames = CompletionFrames(head)

    def frame(e: SequenceEvent) -> bytes:
        if body.logprobs is None and e.finish_reason is None and (not body.echo or e.choice in echoed):
            return frames.running_text(e.choice, e.text)  # the common chunk, pre-encoded
        return sse_frame(chunk(e))

    def chunk(e: SequenceEvent) -> dict[str, Any]:
        lp = logprobs_of(e.choice, e.token_ids, e.logprobs or [])
        text = echo(e.choice, e.text)
        echoed.add(e.choice)
        return {
            **head,
            "choices": [
                {
                    "index": e.choice,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": e.finish_reason,
                    "stop_reason": e.stop_reason,
                }
            ],
        }

    def full(per_choice: list[list[SequenceEvent]]) -> dict[str, Any]:
        choices = []
        for choice, events in enumerate(per_choice):
            text, tokens, lps, reason, stop_reason = _join(events)
            choices.append(
                {
                    "index": choice,
                    "text": echo(choice, text),
                    "logprobs": logprobs_of(choice, tokens, lps),
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                    "prompt_logprobs": prompt_logprobs_of(choice // params.n),
                }
            )
        return {
            **head,
            "choices": choices,
            "usage": usage(gen.num_prompt_tokens, gen.num_output_tokens, gen.num_cached_tokens),
        }

    return await _respond(gen, request, body.stream, frame, lambda: _usage_tail(body, head, gen), full)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = _state(request)
    lora = state.loras.select(body.model, state.model_name)  # a served LoRA adapter, or None (404 if unknown)
    _warn_ignored(body, "/v1/chat/completions")
    harmony = state.harmony_for(body.chat_template)
    template = state.template(body.chat_template) if harmony is None else None
    plan = chat_plan(state.config, body, template, harmony)
    clash = [k for k in RENDER_ARGUMENTS if k in (body.chat_template_kwargs or {})]
    if clash:
        raise ApiError.invalid(
            f"chat_template_kwargs.{clash[0]} is set by the server (from the request's own "
            "fields), not by chat_template_kwargs",
            "chat_template_kwargs",
        )
    messages = [m.model_dump() for m in body.messages]
    if template is None:  # harmony (gpt-oss): openai-harmony renders the token ids
        text, prompt = (
            "",
            tokenize(state.tokenizer, plan.harmony_prompt(messages, body, "messages"), "messages", state.vocab_size),
        )
    else:
        try:
            text = template.render(
                messages,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                **plan.template_kwargs(body),
            )
        except ApiError:
            raise
        except Exception as err:
            raise ApiError.invalid(str(err), "messages") from None
        prompt = tokenize(state.tokenizer, text, "messages", state.vocab_size)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    top = body.top_logprobs if body.top_logprobs is not None else 0
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError.invalid("top_logprobs needs logprobs=true", "top_logprobs")
    check_logprobs(state.max_logprobs, top_logprobs=body.top_logprobs, prompt_logprobs=body.prompt_logprobs)
    params = sampling_params(
        body, max_tokens=_max_tokens(state, requested, [prompt], field), logprobs=top if body.logprobs else None
    )
    params, plan = plan.sampling(params, text), plan.for_prompt(text)
    parsers = [plan.parser() for _ in range(params.n)]
    state.check_capacity(1)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    gen = Generation(
        state.client,
        state.tokenizer,
        state.metrics,
        request_id,
        [prompt],
        params,
        body.stream,
        state.config.serve.log_requests,
        plan.field_names(body),
        lora=lora,
    )
    head = envelope("chat.completion.chunk", request_id, state.model_name)
    text_of = _token_text(state)
    started: set[int] = set()

    def logprobs_of(tokens: list[int], lps: list) -> Optional[dict[str, Any]]:
        return chat_logprobs(tokens, lps, top, text_of) if body.logprobs else None

    def chunk(e: SequenceEvent) -> dict[str, Any]:
        delta, finish_reason = streamed(parsers[e.choice], e.text, e.finish_reason, e.token_ids)
        if e.choice not in started:
            started.add(e.choice)
            delta = {"role": "assistant", **delta}
        return {
            **head,
            "choices": [
                {
                    "index": e.choice,
                    "delta": delta,
                    "logprobs": logprobs_of(e.token_ids, e.logprobs or []),
                    "finish_reason": finish_reason,
                    "stop_reason": e.stop_reason,
                }
            ],
        }

    def full(per_choice: list[list[SequenceEvent]]) -> dict[str, Any]:
        choices = []
        outputs = []
        for choice, events in enumerate(per_choice):
            text, tokens, lps, reason, stop_reason = _join(events)
            outputs.append((tokens, text))
            message, reason = finished(parsers[choice], text, reason, tokens)
            choices.append(
                {
                    "index": choice,
                    "message": message,
                    "logprobs": logprobs_of(tokens, lps),
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                }
            )
        return {
            **head,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage(
                gen.num_prompt_tokens,
                gen.num_output_tokens,
                gen.num_cached_tokens,
                plan.reasoning_tokens(state.tokenizer, outputs),
            ),
        }

    def streamed_reasoning() -> Optional[int]:
        seqs = [gen.sequence(c) for c in range(params.n)]
        return plan.reasoning_tokens(state.tokenizer, [(s.token_ids, s.text) for s in seqs])

    return await _respond(
        gen, request, body.stream, chunk, lambda: _usage_tail(body, head, gen, streamed_reasoning), full
    )


@router.post("/v1/embeddings", response_model=None)
async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
    state = _state(request)
    check_model(body.model, [state.model_name])
    _warn_ignored(body, "/v1/embeddings")
    prompts = [tokenize(state.tokenizer, p, "input", state.vocab_size) for p in prompt_list(body.input, "input")]
    for p in prompts:
        if len(p) > state.max_model_len:
            raise ApiError.invalid(
                f"this model's maximum context length is {state.max_model_len} tokens, but an "
                f"input has {len(p)} tokens",
                "input",
            )
    state.check_capacity(len(prompts))
    params = pooling_params(body.dimensions)
    request_id = f"embd-{uuid.uuid4().hex}"
    queue: asyncio.Queue = asyncio.Queue()
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    vectors: dict[str, list[float]] = {}
    try:
        for engine_id, prompt in zip(ids, prompts):
            state.client.add(engine_id, prompt, queue, pooling_params=params)
        while len(vectors) < len(ids):
            try:
                item = await asyncio.wait_for(queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ClientDisconnected("the client disconnected") from None
                continue
            if isinstance(item, RequestFailed):
                raise ApiError.invalid(item.message) if item.kind == "invalid" else ApiError(503, item.message)
            if item.finish_reason != "pooled" or item.embedding is None:
                raise ApiError(500, item.error or f"the embedding request ended with {item.finish_reason}")
            vectors[item.request_id] = item.embedding
    finally:
        unfinished = [i for i in ids if i not in vectors]
        state.client.abort(unfinished)
        for engine_id in ids:
            state.client.release(engine_id)
    data = []
    for index, engine_id in enumerate(ids):
        vector = vectors[engine_id]
        encoded: Any = (
            base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            if body.encoding_format == "base64"
            else vector
        )
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    num_tokens = sum(len(p) for p in prompts)
    return {
        "object": "list",
        "data": data,
        "model": state.model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
