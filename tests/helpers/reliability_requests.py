"""The catalogue's bad requests, each sent to a running engine while other requests run (they must not be
disturbed), and the Whisper requests with bad audio."""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from framework import (
    LLM,
    InvalidRequestError,
    PoolingParams,
    SamplingParams,
    StructuredOutputsParams,
)
from helpers.reliability_case import Case, tiny


@functools.cache
def _whisper() -> LLM:
    """The whisper-tiny geometry with random weights (built once: audio cases need an encoder-decoder model)."""
    return LLM("whisper-tiny", device="cpu", max_num_seqs=1, max_model_len=32)


def _audio(**prompt: Any) -> None:
    """Generate for one audio prompt: 1 s of a quiet tone at 16 kHz, with `prompt`'s keys replacing its own."""
    samples = (0.1 * np.sin(np.arange(16000) / 10)).astype(np.float32)
    _whisper().generate([{"audio": (samples, 16000), **prompt}], use_tqdm=False)


def _add(ctx: Any, prompt: list[int], params: Optional[SamplingParams] = None, request_id: str = "bad") -> None:
    ctx.llm.engine.add_request(request_id, prompt, params or SamplingParams(max_tokens=4))


V = 320  # the tiny model's vocabulary
REQUEST_CASES = [
    # ---- requests (sent while other requests run) ---------------------------------------------------------
    Case(
        "prompt-too-long",
        "request",
        "prompt of 1200 tokens, max_model_len 1024",
        InvalidRequestError,
        "the prompt has 1200 tokens but max_model_len is 1024",
        lambda ctx: _add(ctx, [1] * 1200),
        True,
    ),
    Case(
        "prompt-fills-context",
        "request",
        "prompt of exactly max_model_len tokens (no room to generate)",
        InvalidRequestError,
        "the prompt has 1024 tokens but max_model_len is 1024",
        lambda ctx: _add(ctx, [1] * 1024),
        True,
    ),
    Case(
        "empty-prompt", "request", "`[]`", InvalidRequestError, "the prompt is empty", lambda ctx: _add(ctx, []), True
    ),
    Case(
        "token-above-vocab",
        "request",
        "token id 5000",
        InvalidRequestError,
        f"token id 5000 is outside the vocabulary [0, {V})",
        lambda ctx: _add(ctx, [1, 5000]),
        True,
    ),
    Case(
        "negative-token",
        "request",
        "token id -1",
        InvalidRequestError,
        f"token id -1 is outside the vocabulary [0, {V})",
        lambda ctx: _add(ctx, [1, -1]),
        True,
    ),
    Case(
        "non-int-token",
        "request",
        "token id 1.5",
        InvalidRequestError,
        f"token id 1.5 is outside the vocabulary [0, {V})",
        lambda ctx: _add(ctx, [1, 1.5]),
        True,
    ),
    Case(
        "max-tokens-zero",
        "request",
        "`max_tokens=0`",
        InvalidRequestError,
        "max_tokens=0 is invalid",
        lambda ctx: SamplingParams(max_tokens=0),
        True,
    ),
    Case(
        "max-tokens-negative",
        "request",
        "`max_tokens=-3`",
        InvalidRequestError,
        "max_tokens=-3 is invalid",
        lambda ctx: SamplingParams(max_tokens=-3),
        True,
    ),
    Case(
        "temperature",
        "request",
        "`temperature=-1`",
        InvalidRequestError,
        "temperature=-1.0 is invalid",
        lambda ctx: SamplingParams(temperature=-1.0),
        True,
    ),
    Case(
        "top-p-zero",
        "request",
        "`top_p=0`",
        InvalidRequestError,
        "top_p=0.0 is invalid: must be in (0, 1]",
        lambda ctx: SamplingParams(top_p=0.0),
        True,
    ),
    Case(
        "top-p-above-one",
        "request",
        "`top_p=1.5`",
        InvalidRequestError,
        "top_p=1.5 is invalid",
        lambda ctx: SamplingParams(top_p=1.5),
        True,
    ),
    Case(
        "top-k",
        "request",
        "`top_k=-5`",
        InvalidRequestError,
        "top_k=-5 is invalid",
        lambda ctx: SamplingParams(top_k=-5),
        True,
    ),
    Case(
        "min-p",
        "request",
        "`min_p=1.5`",
        InvalidRequestError,
        "min_p=1.5 is invalid",
        lambda ctx: SamplingParams(min_p=1.5),
        True,
    ),
    Case(
        "presence-penalty",
        "request",
        "`presence_penalty=3`",
        InvalidRequestError,
        "presence_penalty=3.0 is invalid",
        lambda ctx: SamplingParams(presence_penalty=3.0),
        True,
    ),
    Case(
        "frequency-penalty",
        "request",
        "`frequency_penalty=-3`",
        InvalidRequestError,
        "frequency_penalty=-3.0 is invalid",
        lambda ctx: SamplingParams(frequency_penalty=-3.0),
        True,
    ),
    Case(
        "repetition-penalty",
        "request",
        "`repetition_penalty=0`",
        InvalidRequestError,
        "repetition_penalty=0.0 is invalid",
        lambda ctx: SamplingParams(repetition_penalty=0.0),
        True,
    ),
    Case(
        "min-tokens",
        "request",
        "`min_tokens=20, max_tokens=10`",
        InvalidRequestError,
        "min_tokens=20 is invalid",
        lambda ctx: SamplingParams(min_tokens=20, max_tokens=10),
        True,
    ),
    Case(
        "too-many-logprobs",
        "request",
        "`logprobs=50` (sampler.max_logprobs=20)",
        InvalidRequestError,
        "logprobs=50 exceeds sampler.max_logprobs=20",
        lambda ctx: _add(ctx, [1, 2], SamplingParams(logprobs=50)),
        True,
    ),
    Case(
        "too-many-prompt-logprobs",
        "request",
        "`prompt_logprobs=21`",
        InvalidRequestError,
        "prompt_logprobs=21 exceeds sampler.max_logprobs=20",
        lambda ctx: _add(ctx, [1, 2], SamplingParams(prompt_logprobs=21)),
        True,
    ),
    Case(
        "stop-token-outside-vocab",
        "request",
        "`stop_token_ids=[999]`",
        InvalidRequestError,
        f"SamplingParams.stop_token_ids has token id 999, outside the vocabulary [0, {V})",
        lambda ctx: _add(ctx, [1, 2], SamplingParams(stop_token_ids=[999])),
        True,
    ),
    Case(
        "structured-two-constraints",
        "request",
        "`StructuredOutputsParams(regex=..., choice=...)`",
        InvalidRequestError,
        "exactly one of json, regex, choice, grammar, json_object must be set (got regex, choice)",
        lambda ctx: StructuredOutputsParams(regex="a", choice=["b"]),
        True,
    ),
    Case(
        "structured-bad-regex",
        "request",
        '`StructuredOutputsParams(regex="[a-")`',
        InvalidRequestError,
        "SamplingParams.structured_outputs.regex is invalid",
        lambda ctx: _add(ctx, [1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-"))),
        True,
    ),
    Case(
        "structured-bad-schema",
        "request",
        '`StructuredOutputsParams(json={"type": "strin"})`',
        InvalidRequestError,
        "SamplingParams.structured_outputs.json is invalid: Invalid type: strin",
        lambda ctx: _add(
            ctx, [1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "strin"}))
        ),
        True,
    ),
    Case(
        "prompt-wrong-type",
        "request",
        '`LLM.generate(["ok", None])`',
        InvalidRequestError,
        "prompt 1 is None: a prompt is a string, a list of token ids",
        lambda ctx: ctx.llm.generate(["ok", None], use_tqdm=False),
        True,
    ),
    Case(
        "sampling-params-wrong-type",
        "request",
        "`LLM.generate(two_prompts, [params, None])`",
        InvalidRequestError,
        "sampling_params[1] is None, not a SamplingParams",
        lambda ctx: ctx.llm.generate([[1, 2], [3, 4]], [SamplingParams(), None], use_tqdm=False),
        True,
    ),
    Case(
        "pooling-params-wrong-type",
        "request",
        "`LLM.encode(two_prompts, SamplingParams())`",
        InvalidRequestError,
        "pooling_params is a SamplingParams, not a PoolingParams or a list of them",
        lambda ctx: ctx.llm.encode([[1, 2], [3, 4]], SamplingParams(), use_tqdm=False),
        True,
    ),
    Case(
        "embed-on-whisper",
        "request",
        "`LLM.encode` on a Whisper model",
        InvalidRequestError,
        "embeddings need a decoder-only text model",
        lambda ctx: _whisper().encode([[1, 2]], PoolingParams(), use_tqdm=False),
    ),
    Case(
        "audio-rate-not-a-number",
        "request",
        'Whisper `{"audio": (samples, None)}`',
        InvalidRequestError,
        "'audio' sampling_rate must be a number of Hz, got None",
        lambda ctx: _audio(audio=(np.zeros(160), None)),
    ),
    Case(
        "audio-nan-samples",
        "request",
        "Whisper audio samples holding NaN",
        InvalidRequestError,
        "'audio' samples contain NaN or infinite values",
        lambda ctx: _audio(audio=(np.full(160, np.nan, np.float32), 16000)),
    ),
    Case(
        "audio-int16-samples",
        "request",
        "Whisper audio as 16-bit PCM integers",
        InvalidRequestError,
        "'audio' samples must be floats in [-1, 1]",
        lambda ctx: _audio(audio=(np.zeros(160, np.int16), 16000)),
    ),
    Case(
        "decoder-prompt-not-ids",
        "request",
        'Whisper `"decoder_prompt": "en"`',
        InvalidRequestError,
        "'decoder_prompt' must be a list of token ids (ints), got 'en'",
        lambda ctx: _audio(decoder_prompt="en"),
    ),
    Case(
        "duplicate-request-id",
        "request",
        "an id that is still in flight",
        InvalidRequestError,
        "request id 'ok-0' is already in use",
        lambda ctx: _add(ctx, [1, 2], request_id="ok-0"),
        True,
    ),
    Case(
        "v1-unsupported-param",
        "request",
        "`presence_penalty` with `runner=v1`",
        InvalidRequestError,
        "the V1 runner does not apply SamplingParams presence_penalty",
        lambda ctx: tiny(runner="v1").engine.add_request("r", [1, 2], SamplingParams(presence_penalty=0.5)),
    ),
    Case(
        "abort-unknown-id",
        "request",
        "`abort_request` of an unknown or finished id",
        None,
        "returns None; nothing else changes",
        lambda ctx: ctx.llm.engine.abort_request("never-sent"),
        True,
    ),
]
