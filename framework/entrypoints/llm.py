"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
import reprlib
import sys
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, TypeVar, Union

from tqdm import tqdm

from framework.config.schema import Mrv2Config
from framework.engine.core import EngineCore
from framework.engine.parallel_sampling import merge_sequences
from framework.engine.request import RequestOutput
from framework.entrypoints.harmony.chat import HarmonyChat, harmony_chat_for
from framework.entrypoints.llm_config import config_from_kwargs
from framework.entrypoints.offline_chat import ChatOptions, prepare_chat
from framework.params.encoder_input import EncoderInput
from framework.params.lora_request import LoRARequest
from framework.params.pooling_params import PoolingParams, PoolingRequestOutput
from framework.params.prefix_cache import PrefixCacheStats
from framework.params.sampling_params import InvalidRequestError, SamplingParams

# Text, token ids (either may come wrapped as vLLM does: {"prompt": text}, {"prompt_token_ids": ids}), or
# (encoder-decoder models such as Whisper) an audio prompt dict: {"audio": (array, sampling_rate)} or
# {"input_features": tensor}, optionally with "decoder_prompt", "language", "task".
Prompt = Union[str, Sequence[int], Mapping[str, Any]]


# vLLM's TextPrompt {"prompt": text} and TokensPrompt {"prompt_token_ids": ids}, alone in their dict.
_VLLM_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


def _is_array(x: Any) -> bool:
    """A numpy array or torch tensor (anything with `tolist` and `ndim`): token ids as Python ints via `tolist`."""
    return hasattr(x, "tolist") and hasattr(x, "ndim")


def _prompt_list(prompts: Union[Prompt, Sequence[Prompt]]) -> list[Prompt]:
    """One prompt (text, a token-id list or an audio dict) or a list of them, as a list; anything else (None, a
    number) raises `InvalidRequestError` naming the prompt, instead of a `TypeError` from deep inside. Token ids
    may come as a numpy array or torch tensor (1-D: one prompt; 2-D: one per row)."""
    if _is_array(prompts):
        prompts = prompts.tolist()  # type: ignore[union-attr]
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        listed: list[Any] = [prompts]
    else:
        listed = list(prompts) if isinstance(prompts, Iterable) else [prompts]
    for i, prompt in enumerate(listed):
        if isinstance(prompt, Mapping) and len(prompt) == 1 and _VLLM_PROMPT_KEYS.intersection(prompt):
            listed[i] = prompt = next(iter(prompt.values()))  # vLLM's TextPrompt / TokensPrompt: what it holds
        if not isinstance(prompt, Iterable):  # a str, a Mapping and a sequence of ids all are
            raise InvalidRequestError(
                f"prompt {i} is {reprlib.repr(prompt)}: a prompt is a string, a list of "
                "token ids or (Whisper) an audio dict"
            )
    return listed  # type: ignore[return-value]


Params = TypeVar("Params", SamplingParams, PoolingParams)


def _params_list(
    given: Union[Params, Sequence[Params], None],
    num_prompts: int,
    kind: type[Params] = SamplingParams,
    name: str = "sampling_params",
) -> list[Params]:
    """One `kind` (`SamplingParams` or `PoolingParams`) per prompt: the one given (or the default) for all, or the
    list given, checked; `name` is the argument named in errors."""
    if given is None or isinstance(given, kind):
        return [given or kind()] * num_prompts
    if isinstance(given, (str, Mapping, SamplingParams, PoolingParams)) or not isinstance(given, Iterable):
        raise InvalidRequestError(f"{name} is a {type(given).__name__}, not a {kind.__name__} or a list of them")
    params = list(given)
    for i, p in enumerate(params):
        if not isinstance(p, kind):
            raise InvalidRequestError(f"{name}[{i}] is {reprlib.repr(p)}, not a {kind.__name__}")
    if len(params) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(params)} {kind.__name__}")
    return params


def _lora_list(
    lora: Union[LoRARequest, Sequence[Optional[LoRARequest]], None], num_prompts: int
) -> list[Optional[LoRARequest]]:
    """One adapter (or None) per prompt."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * num_prompts
    loras = list(lora)
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request: {len(loras)} adapters for {num_prompts} prompts")
    return loras


class LLM:
    """An engine in this process. `model` is a local HF directory or an embedded model name ("tiny", "random_tiny").

    Keyword arguments map to config keys (`max_model_len`, `block_size`, `num_kv_blocks`, `kv_cache_dtype`,
    `max_num_seqs`, `max_num_batched_tokens`, `dtype`, `device`, `runner`, `seed`, ...); or pass a full `config`.
    """

    def __init__(self, model: str = "tiny", *, config: Optional[Mrv2Config] = None, **kwargs: Any) -> None:
        self.config = config if config is not None else config_from_kwargs(model, kwargs)
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()
        self._harmony: Optional[tuple[Optional[HarmonyChat]]] = None  # (the format,) once `harmony_chat` looked

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, Any]:
        """Engine counters since start: `spec_decode` holds drafts, draft tokens, accepted tokens, mean
        acceptance length and per-position acceptance (all zero without speculation)."""
        return {"spec_decode": self.engine.spec_metrics.as_dict()}

    def _inputs(self, prompt: Prompt) -> tuple[list[int], Optional[EncoderInput]]:
        """(prompt token ids, encoder input): audio dicts become a decoder prompt plus encoder features."""
        if isinstance(prompt, Mapping):
            if self.engine.audio is None:
                arch = type(self.engine.loaded.model).__name__
                raise InvalidRequestError(
                    f"audio prompts need an encoder-decoder model such as Whisper; this model "
                    f"({arch}) takes text or token ids"
                )
            return self.engine.audio.process(prompt)
        if self.engine.audio is not None:  # before tokenizing: the checkpoint may have no tokenizer at all
            self.engine._check_encoder_input("", None)
        return self._token_ids(prompt), None

    def shutdown(self) -> None:
        """Free the KV caches and CUDA graphs and stop the other ranks of a parallel run now (otherwise this happens
        when the LLM is garbage-collected or at exit); the LLM cannot generate after."""
        self.engine.shutdown()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix caching since the engine started: `queries` (tokens looked up), `hits` (tokens served from
        the cache) and `hit_rate` (see docs/prefix-caching.md)."""
        return self.engine.prefix_cache_stats

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; the next requests compute their prompts from scratch."""
        self.engine.reset_prefix_cache()

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, Mapping):
            raise InvalidRequestError("audio prompts are for LLM.generate with an encoder-decoder model")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer.json: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        return prompt.tolist() if _is_array(prompt) else list(prompt)  # numpy / torch scalars are no token ids

    def _queue(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None],
        output_kind: str,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> dict[str, int]:
        """Validate every request, then queue them all (one bad prompt queues nothing); returns their ids (in prompt
        order) and how many sequences each produces (`SamplingParams.n`)."""
        prompts = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompts))
        loras = _lora_list(lora_request, len(prompts))
        requests = []
        for prompt, p, lora in zip(prompts, params, loras):
            if p.output_kind != output_kind:
                p = dataclasses.replace(p, output_kind=output_kind)
            ids, encoder_input = self._inputs(prompt)
            request_id = f"gen-{next(self._ids)}"
            self.engine._validate(request_id, ids, p, encoder_input)
            self.engine.lora_catalog.check(request_id, lora)
            requests.append((request_id, ids, p, prompt if isinstance(prompt, str) else None, encoder_input, lora))
        for request_id, ids, p, text, encoder_input, lora in requests:
            self.engine.add_request(request_id, ids, p, prompt=text, encoder_input=encoder_input, lora_request=lora)
        return {r[0]: r[2].n for r in requests}

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids; audio dicts for Whisper); outputs come back in prompt order.

        `lora_request`: one LoRA adapter for every prompt, or one per prompt (None: the base model); needs
        `enable_lora=True` (config `lora.enable`), see docs/lora.md.

        vLLM's prompt dicts are taken too: `{"prompt": text}` is the text, `{"prompt_token_ids": ids}` the ids.

        A Whisper model takes prompts as `{"audio": (samples, sampling_rate)}` or `{"input_features": tensor
        [mel_bins, frames]}`, optionally with `"decoder_prompt"` (token ids) or `"language"` / `"task"`
        (see `framework.engine.audio_inputs`); a text model refuses them, and a Whisper model refuses text.

        Every request is validated before any is queued, so one bad prompt queues nothing. Each request's
        output is its final one (`output_kind` is taken as "final_only"). With `SamplingParams.n > 1` its
        `outputs` holds the n sequences (the flat fields are sequence 0's).
        """
        expected = self._queue(prompts, sampling_params, "final_only", lora_request)
        finals: dict[str, list[RequestOutput]] = {r: [] for r in expected}
        running = len(expected)
        with tqdm(total=len(expected), desc="generate", unit="req", file=sys.stderr, disable=not use_tqdm) as bar:
            # Until its own requests end: requests another caller queued on the engine keep running (their
            # outputs of these steps are not returned here).
            while running and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in finals:
                        finals[out.request_id].append(out)
                        done = len(finals[out.request_id]) == expected[out.request_id]
                        running -= done
                        bar.update(done)
        return [merge_sequences(finals[r]) for r in expected]

    def chat(
        self,
        messages: Union[Sequence[Mapping[str, Any]], Sequence[Sequence[Mapping[str, Any]]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: Optional[str] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        tool_choice: Any = None,
        parallel_tool_calls: Optional[bool] = None,
        tool_parser: Optional[str] = None,
        reasoning_parser: Optional[str] = None,
        reasoning_effort: Optional[str] = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of `{"role", "content"}` messages) or to several.

        Each conversation is rendered with the checkpoint's chat template (its `chat_template.jinja` or the
        `chat_template` of its `tokenizer_config.json`; `chat_template` overrides it) in a Jinja sandbox, then
        generated like a text prompt. `continue_final_message` continues the last (assistant) message instead
        of starting a new one. A model without a template raises `InvalidRequestError`.

        `tools` / `tool_choice` / `parallel_tool_calls` are OpenAI's (docs/tool_calling.md): the template gets
        the tools, `required` and named choices constrain the output to valid calls, and each sequence's
        `tool_calls` holds the calls parsed from its text (`tool_parser`, default `serve.tool_call_parser` or the
        format the template writes). `reasoning_parser` (default `serve.reasoning_parser`) moves a `<think>`
        section into `reasoning_content` (and counts its tokens in `reasoning_tokens`). A
        `SamplingParams.thinking_token_budget` (default `serve.thinking_token_budget`) ends the thinking after that
        many tokens; it is dropped for a prompt whose template already closed the thinking. `chat_template_kwargs`
        are extra template variables (`enable_thinking`, ...); `reasoning_effort` is one more. A gpt-oss
        checkpoint chats in the harmony format instead (`serve.chat_format`; docs/tool_calling.md): `analysis` is
        `reasoning_content`, `final` the text, calls to `functions.*` the `tool_calls`; `reasoning_effort` is
        low, medium or high.
        """
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        # ChatOptions' fields are this method's keyword arguments, by name.
        options = ChatOptions(**{k: v for k, v in locals().items() if k in ChatOptions.__dataclass_fields__})
        encode = self.engine.tokenizer.encode if self.engine.tokenizer is not None else None
        params = _params_list(sampling_params, len(conversations))
        chat = prepare_chat(self.config, encode, self.harmony_chat, conversations, params, options)  # type: ignore[arg-type]
        return chat.parse(self.generate(chat.prompts, chat.params, use_tqdm=use_tqdm))  # type: ignore[arg-type]

    def harmony_chat(self) -> Optional[HarmonyChat]:
        """The harmony chat format when this model chats in it (`serve.chat_format`), loaded once; None otherwise."""
        if self._harmony is None:
            loaded = self.engine.loaded
            self._harmony = (harmony_chat_for(self.config.serve.chat_format, loaded.hf_config, loaded.path),)
        return self._harmony[0]

    def encode(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Embed every prompt (text or token ids): one vector per prompt, in prompt order.

        The prompt runs through the same scheduler, slots and paged KV cache as generation (prefill only,
        chunked when long); its hidden states after the final norm are pooled as `PoolingParams` says
        (default: `model.pooling`, L2-normalised). Every request is validated before any is queued.
        """
        prompts = _prompt_list(prompts)
        params = _params_list(pooling_params, len(prompts), PoolingParams, "pooling_params")
        requests = []
        for prompt, p in zip(prompts, params):
            request_id = f"embed-{next(self._ids)}"
            p = self.engine.validate_pooling(request_id, p)  # first: it names a model that embeds nothing
            ids = self._token_ids(prompt)
            self.engine._validate(request_id, ids, SamplingParams(temperature=0.0, max_tokens=1), pooling=True)
            requests.append((request_id, ids, p, prompt if isinstance(prompt, str) else None))
        for request_id, ids, p, text in requests:
            self.engine.add_request(request_id, ids, None, prompt=text, pooling_params=p)
        outputs: dict[str, PoolingRequestOutput] = {}
        expected = {r[0] for r in requests}
        with tqdm(total=len(requests), desc="encode", unit="req", file=sys.stderr, disable=not use_tqdm) as bar:
            # Until its own requests end, as in `generate`: other callers' requests keep running.
            while len(outputs) < len(requests) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in expected:
                        outputs[out.request_id] = out  # type: ignore[assignment]
                        bar.update(1)
        return [outputs[r[0]] for r in requests]  # type: ignore[misc]

    embed = encode

    def generate_stream(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
    ) -> Iterator[RequestOutput]:
        """Generate for every prompt and yield deltas as they are produced (`output_kind="delta"`).

        Each yielded `RequestOutput` holds the tokens, text and logprobs that request gained since its
        previous one; the last output of a request has `finished=True`. Requests are interleaved; tell
        them apart by `request_id` (or by `prompt`/`prompt_token_ids`). Joining a request's deltas gives
        what `generate` returns for it.
        Outputs of a request with `SamplingParams.n > 1` are told apart by their `index`.
        A stream left before its end (`break`, or the generator closed or dropped) aborts its requests that are
        still running, so they free their slots and blocks.
        """
        expected = self._queue(prompts, sampling_params, "delta")
        try:
            while self.engine.has_unfinished_requests():
                yield from self.engine.step()
        except GeneratorExit:
            for request_id in expected:
                self.engine.abort_request(request_id)  # None (nothing changes) for one that already ended
            raise
