"""OpenAI request bodies -> the engine's `SamplingParams` / `PoolingParams`, and the prompt's token ids.

Ranges are checked by `SamplingParams.validate`, so an out-of-range field gets the engine's own message
(naming the field and its allowed range) as an HTTP 400.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from framework.entrypoints.serve.errors import ApiError
from framework.entrypoints.serve.openai_models import PromptInput, SamplingFields
from framework.params.pooling_params import PoolingParams
from framework.params.sampling_params import InvalidRequestError, SamplingParams, first_invalid_token_index
from framework.params.structured_outputs import structured_outputs_from_openai


def prompt_list(prompt: PromptInput, field: str) -> list[Union[str, list[int]]]:
    """One prompt or a batch of them (strings or token-id lists) as a list."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError.invalid(f"'{field}' is empty", field)
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    items = list(prompt)
    if any(isinstance(p, list) and not p for p in items) or any(p == "" for p in items):
        raise ApiError.invalid(f"'{field}' holds an empty prompt", field)
    return items  # type: ignore[return-value]


def tokenize(tokenizer: Any, prompt: Union[str, list[int]], field: str, vocab_size: int) -> list[int]:
    """The prompt's token ids; ids sent as such must be in the vocabulary (the server decodes them for `echo`)."""
    if isinstance(prompt, list):
        bad = first_invalid_token_index(prompt, vocab_size)
        if bad is not None:
            raise ApiError.invalid(
                f"'{field}' holds token id {prompt[bad]}, outside the vocabulary [0, {vocab_size})", field
            )
        return prompt
    if tokenizer is None:
        raise ApiError.invalid(f"this model has no tokenizer.json: send '{field}' as token ids", field)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ApiError.invalid(f"'{field}' tokenises to no tokens", field)
    return ids


def max_tokens_for(requested: Optional[int], num_prompt_tokens: int, max_model_len: int, field: str) -> int:
    """The output budget: what was asked for (it must fit the context), else whatever the context leaves."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ApiError.invalid(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens (prompt plus at least one output token must fit)",
            "messages" if field == "max_completion_tokens" else "prompt",
        )
    if requested is None:
        return room
    if requested > room:
        raise ApiError.invalid(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{num_prompt_tokens} prompt tokens and asks for {requested} output tokens "
            f"({field}), {num_prompt_tokens + requested} in all",
            field,
        )
    return requested


def sampling_params(
    body: SamplingFields, *, max_tokens: int, logprobs: Optional[int], prompt_logprobs: Optional[int] = None
) -> SamplingParams:
    """Build and validate the engine's parameters (400 with the engine's message when a value is out of range)."""
    if body.stream_options is not None and not body.stream:  # as OpenAI: not silently ignored
        raise ApiError.invalid("stream_options is only allowed with stream=true", "stream_options")
    for kind in ("json", "regex", "choice", "grammar"):
        if getattr(body, f"guided_{kind}") is not None:
            raise ApiError.invalid(
                f"guided_{kind} is vLLM's older field and is not read here: send "
                f'structured_outputs={{"{kind}": ...}} instead (or response_format)',
                f"guided_{kind}",
            )
    values: dict[str, Any] = dict(
        n=body.n,
        max_tokens=max_tokens,
        stop=body.stop,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=body.logit_bias,
        logprobs=logprobs,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else body.prompt_logprobs,
        allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words,
    )
    for name, default in (
        ("temperature", 1.0),
        ("top_p", 1.0),
        ("top_k", 0),
        ("min_p", 0.0),
        ("repetition_penalty", 1.0),
    ):
        value = getattr(body, name)
        values[name] = default if value is None else value
    try:
        values["structured_outputs"] = structured_outputs_from_openai(body.response_format, body.structured_outputs)
        return SamplingParams(**values)
    except InvalidRequestError as err:
        raise ApiError.invalid(str(err)) from None
    except (TypeError, ValueError) as err:
        raise ApiError.invalid(f"invalid sampling parameters: {err}") from None


def engine_field_names(body: SamplingFields) -> dict[str, str]:
    """The request field behind the engine's name of the constraint: the engine compiles the schema, regex or
    grammar and refuses a bad one as `SamplingParams.structured_outputs.<kind>`, which the client did not send."""
    # A grammar that ends before min_tokens names both (and the thinking budget that lets the model think first).
    names = {"SamplingParams.min_tokens": "min_tokens", "SamplingParams.thinking_token_budget": "thinking_token_budget"}
    if body.response_format is not None and body.structured_outputs is None:  # only a schema can fail to compile
        return {**names, "SamplingParams.structured_outputs.json": "response_format.json_schema.schema"}
    return {**names, "SamplingParams.structured_outputs": "structured_outputs"}


def check_logprobs(limit: int, **requested: Optional[int]) -> None:
    """400 naming the field as the client sent it (chat's `top_logprobs`) when it asks for more logprobs than the
    engine keeps (`sampler.max_logprobs`); the engine would refuse it under its own name."""
    for field, value in requested.items():
        if value is not None and value > limit:
            raise ApiError.invalid(f"{field}={value} exceeds sampler.max_logprobs={limit}", field)


def pooling_params(dimensions: Optional[int]) -> PoolingParams:
    return PoolingParams(dimensions=dimensions)


def check_model(name: Optional[str], served: Sequence[str]) -> None:
    """404 for a model this server does not serve (a request without `model` gets the served one)."""
    if name is not None and name not in served:
        raise ApiError(404, f"the model '{name}' does not exist; this server serves: {', '.join(served)}", "model")
