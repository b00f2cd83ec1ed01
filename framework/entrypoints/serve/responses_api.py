"""POST /v1/responses: OpenAI's Responses API on the chat machinery, stateless.

The request's `input` (text, or message / `function_call` / `function_call_output` items) and `instructions` become
chat messages, its flat function tools become chat tools, and the turn runs as a chat completion would (the chat
template, `tool_choice`, the tool-call and reasoning parsers, `text.format` as a JSON schema; gpt-oss's harmony format
where the model chats in it). The answer comes back
as `output` items (`reasoning`, `message`, `function_call`), or streamed as typed events (`responses_items`).
Nothing is stored: `store: true` and `previous_response_id` are refused by name.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from framework.entrypoints.chat_output import ChatOutputParser
from framework.entrypoints.serve.chat_tools import ChatPlan, chat_plan
from framework.entrypoints.serve.errors import ApiError, loggable
from framework.entrypoints.serve.generation import Generation, SequenceEvent
from framework.entrypoints.serve.openai_models import ChatCompletionRequest, _RequestBody
from framework.entrypoints.serve.params import max_tokens_for, sampling_params, tokenize
from framework.entrypoints.serve.responses_items import ResponseEvents, output_items, sse_event
from framework.entrypoints.serve.responses_options import (
    AnswerLogprobs,
    effort_budget,
    harmony_effort,
    logprobs_k,
    token_text,
)
from framework.entrypoints.serve.state import ServerState

router = APIRouter()
logger = logging.getLogger(__name__)


class ResponsesRequest(_RequestBody):
    """POST /v1/responses (the fields this server reads; others are named in a warning and ignored)."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]] = Field(min_length=1)
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stream: bool = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    text: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    thinking_token_budget: Optional[int] = None
    structured_outputs: Optional[dict[str, Any]] = None  # vLLM's extra, as in the chat API
    top_logprobs: Optional[int] = None
    include: Optional[list[str]] = None


def _text_of(content: Any, where: str) -> str:
    """A message's content: text, or a list of `input_text` / `output_text` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError.invalid(f"{where}.content[{i}] of type {kind!r} is not supported (text only)", "input")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ApiError.invalid(f"{where}.content must be text or a list of text parts", "input")


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages (a run of `function_call` items is one assistant turn)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError.invalid(f"{where}.role={loggable(str(role))} is not a message role", "input")
            content = _text_of(item.get("content"), where)
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": _text_of(output, f"{where}.output")}
            )
        elif kind != "reasoning":  # the model's own earlier thinking: not fed back (templates drop it too)
            raise ApiError.invalid(f"{where}.type={loggable(str(kind))} is not supported", "input")
    return messages


def chat_tools(body: ResponsesRequest) -> tuple[Optional[list[dict[str, Any]]], Any]:
    """The Responses API's flat function tools and tool_choice in the chat API's shape."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                kind = loggable(str(tool.get("type")))
                raise ApiError.invalid(f"tools[{i}].type={kind} is not supported (function tools only)", "tools")
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def as_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request runs as (400 naming what has no stateless meaning)."""
    if body.store:
        raise ApiError.invalid("store=true is not supported: this server keeps no responses (send false)", "store")
    if body.previous_response_id is not None:
        raise ApiError.invalid(
            "previous_response_id is not supported: this server keeps no responses; send the whole conversation "
            "as input items",
            "previous_response_id",
        )
    tools, choice = chat_tools(body)
    fmt = (body.text or {}).get("format") or {"type": "text"}
    response_format = None
    if fmt.get("type") == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "schema"), **fmt}}
    elif fmt.get("type") == "json_object":
        response_format = {"type": "json_object"}
    return ChatCompletionRequest(
        model=body.model,
        messages=chat_messages(body),  # type: ignore[arg-type]
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stream=body.stream,
        response_format=response_format,
        structured_outputs=body.structured_outputs,
        thinking_token_budget=effort_budget(body.reasoning, body.thinking_token_budget),
    )


def _envelope(
    response_id: str, body: ResponsesRequest, state: ServerState, status: str, created: int
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": state.model_name,
        "status": status,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "max_output_tokens": body.max_output_tokens,
        "reasoning": body.reasoning,
        "text": body.text or {"format": {"type": "text"}},
        "metadata": body.metadata or {},
        "store": False,
    }


def _usage(gen: Generation, plan: ChatPlan, tokenizer: Any, tokens: list[int], text: str) -> dict[str, Any]:
    reasoning = plan.reasoning_tokens(tokenizer, [(tokens, text)]) or 0
    return {
        "input_tokens": gen.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": gen.num_cached_tokens},
        "output_tokens": gen.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": gen.num_prompt_tokens + gen.num_output_tokens,
    }


def _finish(envelope: dict[str, Any], finish_reason: Optional[str]) -> dict[str, Any]:
    if finish_reason == "length":
        return {**envelope, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {**envelope, "status": "completed"}


@router.post("/v1/responses", response_model=None)
async def responses(body: ResponsesRequest, request: Request) -> Any:
    state: ServerState = request.app.state.server
    lora = state.loras.select(body.model, state.model_name)  # a served LoRA adapter, or None (404 if unknown)
    if body.model_extra:
        names = ", ".join(loggable(name) for name in sorted(body.model_extra))
        logger.warning("/v1/responses: ignored fields not read by this server: %s", names)
    chat = as_chat_request(body)
    harmony = state.harmony_for(None)
    k = logprobs_k(body.include, body.top_logprobs, state.max_logprobs)
    if harmony is not None:  # gpt-oss: `reasoning.effort` is the prompt's reasoning level, not a thinking budget
        effort = harmony_effort(body.reasoning)
        chat = chat.model_copy(update={"reasoning_effort": effort, "thinking_token_budget": body.thinking_token_budget})
        if k is not None:
            raise ApiError.invalid("the answer's logprobs are not supported in gpt-oss's harmony format", "include")
    template = state.template(None) if harmony is None else None
    plan = chat_plan(state.config, chat, template, harmony)
    messages = chat.model_dump()["messages"]
    if template is None:
        text, ids = "", plan.harmony_prompt(messages, chat, "input")
    else:
        try:
            text = template.render(messages, add_generation_prompt=True, **plan.template_kwargs(chat))
        except ApiError:
            raise
        except Exception as err:
            raise ApiError.invalid(str(err), "input") from None
    prompt = tokenize(state.tokenizer, text if template is not None else ids, "input", state.vocab_size)
    max_tokens = max_tokens_for(body.max_output_tokens, len(prompt), state.max_model_len, "max_output_tokens")
    params = plan.sampling(sampling_params(chat, max_tokens=max_tokens, logprobs=k), text)
    plan = plan.for_prompt(text)
    state.check_capacity(1)
    response_id = f"resp_{uuid.uuid4().hex}"
    gen = Generation(
        state.client,
        state.tokenizer,
        state.metrics,
        response_id,
        [prompt],
        params,
        body.stream,
        state.config.serve.log_requests,
        plan.field_names(chat),
        lora=lora,
    )
    envelope = _envelope(response_id, body, state, "in_progress", int(time.time()))
    parser = plan.parser()
    logprobs = None
    if k is not None:
        logprobs = AnswerLogprobs(k, token_text(state.tokenizer), state.tokenizer, parser.has_reasoning)
    if not body.stream:
        events = [e async for batch in gen.events(request.is_disconnected) for e in batch]
        out_text = "".join(e.text for e in events)
        tokens = [t for e in events for t in e.token_ids]
        finish = events[-1].finish_reason if events else None
        parts = parser.parse(out_text, tokens)
        if logprobs is not None:
            logprobs.add(tokens, [lp for e in events for lp in e.logprobs or []])
        answer_lps = logprobs.whole(parts.content, bool(parts.tool_calls)) if logprobs is not None else []
        return {
            **_finish(envelope, finish),
            "output": output_items(parts, answer_lps),
            "usage": _usage(gen, plan, state.tokenizer, tokens, out_text),
        }
    stream = gen.events(request.is_disconnected, watch_until_first=True)
    try:
        first = await stream.__anext__()  # a request the engine refuses still gets its HTTP 400
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise
    frames = _stream(first, stream, envelope, parser, gen, plan, state.tokenizer, logprobs)
    return StreamingResponse(frames, media_type="text/event-stream")


async def _stream(
    first: list[SequenceEvent],
    events: AsyncIterator[list[SequenceEvent]],
    envelope: dict[str, Any],
    parser: ChatOutputParser,
    gen: Generation,
    plan: ChatPlan,
    tokenizer: Any,
    logprobs: Optional[AnswerLogprobs],
) -> AsyncIterator[str]:
    """`response.created`, `response.in_progress`, the items' events, then `response.completed` (or `.incomplete`);
    an engine failure mid-stream becomes an `error` event."""
    builder = ResponseEvents()
    yield sse_event(builder.event("response.created", response=envelope))
    yield sse_event(builder.event("response.in_progress", response=envelope))
    tokens: list[int] = []
    text, finish = "", None
    try:
        batch: Optional[list[SequenceEvent]] = first
        while batch is not None:
            frames = []
            for e in batch:
                tokens += e.token_ids
                text += e.text
                finish = e.finish_reason or finish
                delta = parser.feed(e.text, e.finish_reason is not None, e.token_ids)
                if logprobs is not None:
                    logprobs.add(e.token_ids, e.logprobs)
                frames += builder.feed(delta, logprobs.delta() if logprobs is not None and delta.content else None)
            yield "".join(sse_event(f) for f in frames)
            batch = await events.__anext__() if finish is None else None
        frames = builder.close({c.id for c in parser.streamed_calls})
        done = _finish(envelope, finish)
        final = {**done, "output": builder.items, "usage": _usage(gen, plan, tokenizer, tokens, text)}
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        frames.append(builder.event(kind, response=final))
        yield "".join(sse_event(f) for f in frames)
    except StopAsyncIteration:
        pass
    except ApiError as err:
        yield sse_event(builder.event("error", code=str(err.status), message=err.message, param=err.param))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
