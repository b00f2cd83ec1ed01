"""The catalogue of bad inputs: each case, how to trigger it, the error type and (a fragment of) its message.

`tests/engine/test_reliability.py` runs every case and checks that `docs/reliability.md` lists exactly these rows
(`markdown_table()`), so the page and the behaviour cannot drift apart.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from framework import (
    LLM,
    ConfigError,
    InvalidRequestError,
    PoolingParams,
    SamplingParams,
    StructuredOutputsParams,
    load_config,
)
from framework.config.registry import MODEL_STATES, RegistryError
from framework.models import CheckpointError


@dataclass(frozen=True)
class Case:
    id: str
    area: str  # config | request | checkpoint | start-up
    bad_input: str  # what the user did, for the docs
    error: Optional[type]  # None: not an error (the documented result is in `message`)
    message: str  # a literal fragment of the message (or the documented result)
    trigger: Callable[[Any], Any]  # ctx -> raises (ctx.llm: a running LLM; ctx.ckpt: a checkpoint dir; ctx.tmp)
    engine_running: bool = False  # requests are in flight when it is triggered; they must not be disturbed


def _tiny(**kwargs: Any) -> LLM:
    return LLM("random_tiny", device="cpu", **kwargs)


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


def _checkpoint(ctx: Any, keep: tuple[str, ...], extra: Optional[dict[str, bytes]] = None) -> Path:
    """A copy of ctx.ckpt with only the files named in `keep`, plus `extra` files."""
    root = ctx.tmp
    for name in keep:
        (root / name).write_bytes((ctx.ckpt / name).read_bytes())
    for name, data in (extra or {}).items():
        (root / name).write_bytes(data)
    return root


def _not_a_model_state(ctx: Any) -> LLM:
    """`model.model_state` naming a registered object that is no ModelState (a plugin's wrong entry point)."""
    MODEL_STATES.register("not-a-state", "collections:deque")
    try:
        return _tiny(model_state="not-a-state")
    finally:
        MODEL_STATES.unregister("not-a-state")


def _with_config(ctx: Any, **fields: Any) -> Path:
    """A copy of ctx.ckpt whose config.json has `fields` set."""
    root = _checkpoint(ctx, ("model.safetensors",))
    cfg = json.loads((ctx.ckpt / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, **fields}))
    return root


V = 320  # the tiny model's vocabulary
CASES = [
    # ---- config -----------------------------------------------------------------------------------------
    Case(
        "unknown-key",
        "config",
        "`scheduler.max_num_seq=4` (typo)",
        ConfigError,
        "scheduler.max_num_seq: unknown key (did you mean 'max_num_seqs'?)",
        lambda ctx: load_config({"scheduler": {"max_num_seq": 4}}),
    ),
    Case(
        "wrong-type",
        "config",
        "`cache.block_size=big`",
        ConfigError,
        "cache.block_size: Input should be a valid integer",
        lambda ctx: load_config({"cache": {"block_size": "big"}}),
    ),
    Case(
        "out-of-range",
        "config",
        "`scheduler.max_num_seqs=0`",
        ConfigError,
        "scheduler.max_num_seqs: Input should be greater than or equal to 1 (got 0)",
        lambda ctx: load_config({"scheduler": {"max_num_seqs": 0}}),
    ),
    Case(
        "unknown-choice",
        "config",
        "`runner.kind=v3`",
        ConfigError,
        "runner.kind: Input should be 'auto', 'v2' or 'v1'",
        lambda ctx: load_config({"runner": {"kind": "v3"}}),
    ),
    Case(
        "unknown-logits-processor",
        "config",
        "`sampler.logits_processors=[nope]`",
        ConfigError,
        "sampler.logits_processors: unknown logits processor 'nope'",
        lambda ctx: _tiny(logits_processors=["nope"]),
    ),
    Case(
        "unknown-speculator",
        "config",
        "`speculator.method=medusa` (not registered)",
        ConfigError,
        "speculator.method=medusa: unknown speculator",
        lambda ctx: _tiny(
            runner="v2",
            config=load_config({"device": "cpu", "speculator": {"method": "medusa", "num_speculative_tokens": 2}}),
        ),
    ),
    Case(
        "unknown-preset",
        "config",
        '`LLM("nope")`: neither a directory nor a preset',
        ConfigError,
        "unknown model.preset 'nope'; embedded presets:",
        lambda ctx: LLM("nope", device="cpu"),
    ),
    Case(
        "model-state-not-a-class",
        "config",
        "`model.model_state` names a registered object that is not a ModelState",
        RegistryError,
        "model state 'not-a-state' is <class 'collections.deque'>, not a ModelState subclass",
        _not_a_model_state,
    ),
    Case(
        "max-model-len-too-long",
        "config",
        "`model.max_model_len` above the model's limit",
        ConfigError,
        "model.max_model_len=4096 exceeds the model's max_position_embeddings=1024",
        lambda ctx: _tiny(max_model_len=4096),
    ),
    Case(
        "unknown-llm-argument",
        "config",
        "`LLM(max_num_seq=4)`",
        TypeError,
        "LLM() got an unknown argument 'max_num_seq'",
        lambda ctx: _tiny(max_num_seq=4),
    ),
    # ---- start-up -----------------------------------------------------------------------------------------
    Case(
        "kv-cache-too-small",
        "start-up",
        "`cache.num_blocks=8` (a request needs 64 blocks)",
        ConfigError,
        "too small for one request of max_model_len=1024",
        lambda ctx: _tiny(num_kv_blocks=8),
    ),
    Case(
        "kv-cache-too-small-config",
        "start-up",
        "`num_blocks x block_size < max_model_len` in the config",
        ConfigError,
        "fewer than one request of model.max_model_len=512",
        lambda ctx: load_config({"model": {"max_model_len": 512}, "cache": {"num_blocks": 4}}),
    ),
    # ---- checkpoint ---------------------------------------------------------------------------------------
    Case(
        "missing-directory",
        "checkpoint",
        "a model path that does not exist",
        CheckpointError,
        "does not exist",
        lambda ctx: LLM(
            str(ctx.tmp / "nowhere"),
            device="cpu",
            config=load_config({"device": "cpu", "model": {"path": str(ctx.tmp / "nowhere"), "preset": None}}),
        ),
    ),
    Case(
        "missing-config",
        "checkpoint",
        "directory without config.json",
        CheckpointError,
        "has no config.json",
        lambda ctx: LLM(str(_checkpoint(ctx, ("model.safetensors",))), device="cpu"),
    ),
    Case(
        "missing-weights-file",
        "checkpoint",
        "config.json but no *.safetensors",
        CheckpointError,
        "has no *.safetensors weights",
        lambda ctx: LLM(str(_checkpoint(ctx, ("config.json",))), device="cpu"),
    ),
    Case(
        "missing-shard",
        "checkpoint",
        "index lists a shard that is absent",
        CheckpointError,
        "is missing shards listed in model.safetensors.index.json",
        lambda ctx: LLM(
            str(
                _checkpoint(
                    ctx,
                    ("config.json",),
                    {
                        "model.safetensors.index.json": json.dumps(
                            {"weight_map": {"lm_head.weight": "model-00002.safetensors"}}
                        ).encode()
                    },
                )
            ),
            device="cpu",
        ),
    ),
    Case(
        "corrupt-safetensors",
        "checkpoint",
        "a truncated / garbage *.safetensors",
        CheckpointError,
        "is not a readable safetensors file",
        lambda ctx: LLM(
            str(_checkpoint(ctx, ("config.json",), {"model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!"})),
            device="cpu",
        ),
    ),
    Case(
        "pickle-only",
        "checkpoint",
        "only pytorch_model.bin (pickle)",
        CheckpointError,
        "only as pickle (pytorch_model.bin); mrv2 never unpickles",
        lambda ctx: LLM(str(_checkpoint(ctx, ("config.json",), {"pytorch_model.bin": b"not unpickled"})), device="cpu"),
    ),
    Case(
        "bad-config-json",
        "checkpoint",
        "config.json that is not JSON",
        CheckpointError,
        "is not valid JSON",
        lambda ctx: LLM(str(_checkpoint(ctx, ("model.safetensors",), {"config.json": b"{not json"})), device="cpu"),
    ),
    Case(
        "unsupported-architecture",
        "checkpoint",
        "`architectures: [GPT2LMHeadModel]`",
        CheckpointError,
        "architecture 'GPT2LMHeadModel' is not supported; registered:",
        lambda ctx: LLM(str(_with_config(ctx, architectures=["GPT2LMHeadModel"])), device="cpu"),
    ),
    Case(
        "quantized-checkpoint",
        "checkpoint",
        "config.json with `quantization_config` (an FP8 checkpoint)",
        CheckpointError,
        "declares a quantized checkpoint (quant_method 'fp8'): mrv2 loads unquantized checkpoints",
        lambda ctx: LLM(str(_with_config(ctx, quantization_config={"quant_method": "fp8"})), device="cpu"),
    ),
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
        lambda ctx: _tiny(runner="v1").engine.add_request("r", [1, 2], SamplingParams(presence_penalty=0.5)),
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


def markdown_table() -> str:
    """The catalogue as the table in docs/reliability.md."""
    rows = ["| id | area | bad input | raises | message contains |", "|---|---|---|---|---|"]
    for case in CASES:
        error = f"`{case.error.__name__}`" if case.error is not None else "nothing"
        message = case.message.replace("|", "\\|")
        rows.append(f"| `{case.id}` | {case.area} | {case.bad_input} | {error} | `{message}` |")
    return "\n".join(rows)
