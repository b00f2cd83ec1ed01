"""Request validation: what `EngineCore.add_request` checks before a request is queued (it changes nothing
when a check fails: `InvalidRequestError` names the request and the reason)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from framework.config.schema import Mrv2Config
from framework.engine.audio_inputs import WhisperPromptProcessor, audio_prompt_help
from framework.models.loaded import LoadedModel
from framework.params.encoder_input import EncoderInput
from framework.params.pooling_params import PoolingParams
from framework.params.request_errors import InvalidRequestError
from framework.params.sampling_params import (
    THINK_END,
    SamplingParams,
    first_invalid_token_index,
    first_out_of_vocab,
)
from framework.runner.interface import ModelRunner
from framework.runner.pooling import hidden_size_of


class RequestValidator:
    """Checks a request against the engine: its vocabulary, limits, tokenizer, runner and model kind."""

    def __init__(
        self,
        config: Mrv2Config,
        loaded: LoadedModel,
        audio: Optional[WhisperPromptProcessor],
        runner: ModelRunner,
        processor_classes: list,
        in_use: Callable[[str], bool],
    ) -> None:
        self.config, self.loaded, self.audio, self.runner = config, loaded, audio, runner
        self.processor_classes = processor_classes
        self.full_sampler = runner.name == "v2"  # the V2 runner, local or behind a parallel driver
        self.in_use = in_use  # whether a request id is taken (queued, running or a parallel-sampling parent)

    def validate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        encoder_input: Optional[EncoderInput] = None,
        pooling: bool = False,
    ) -> SamplingParams:
        """Check the request against the engine (vocabulary, limits, tokenizer); returns the prepared params."""
        params.validate()
        if self.in_use(request_id):
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        self.check_encoder_input(request_id, encoder_input)
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError(f"request '{request_id}': the prompt is empty")
        # An embedding (pooling) request generates nothing: its prompt may fill max_model_len.
        if n > self.loaded.max_model_len or (n == self.loaded.max_model_len and not pooling):
            raise InvalidRequestError(
                f"request '{request_id}': the prompt has {n} tokens but max_model_len is {self.loaded.max_model_len} "
                + ("(an embedding prompt must fit)" if pooling else "(prompt plus at least one output token must fit)")
            )
        vocab = self.loaded.vocab_size
        # bool is an int subclass, but a prompt of True/False is a caller's bug, not token ids 1 and 0.
        bad = first_invalid_token_index(prompt_token_ids, vocab)
        if bad is not None:
            raise InvalidRequestError(
                f"request '{request_id}': token id {prompt_token_ids[bad]!r} is outside the vocabulary [0, {vocab})"
            )
        max_logprobs = self.config.sampler.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise InvalidRequestError(
                    f"request '{request_id}': {name}={value} exceeds sampler.max_logprobs={max_logprobs}"
                )
        if params.stop and self.loaded.tokenizer is None:
            raise InvalidRequestError(
                f"request '{request_id}': SamplingParams.stop needs a tokenizer (this model has no tokenizer.json)"
            )
        prepared = params.clone()
        prepared.resolve_bad_words(self.loaded.tokenizer.encode if self.loaded.tokenizer is not None else None)
        self._resolve_thinking_end(request_id, prepared)
        id_lists = (
            ("stop_token_ids", prepared.stop_token_ids),
            ("logit_bias", list(prepared.logit_bias or ())),
            ("allowed_token_ids", prepared.allowed_token_ids or ()),
            ("bad_words", [t for word in prepared.bad_words_token_ids for t in word]),
            ("thinking_end_token_ids", prepared.thinking_end_token_ids or ()),
        )
        for name, ids in id_lists:
            bad = first_out_of_vocab(ids, vocab) if ids else None
            if bad is not None:
                raise InvalidRequestError(
                    f"request '{request_id}': SamplingParams.{name} has token id {bad}, outside the vocabulary "
                    f"[0, {vocab})"
                )
        self._check_allowed_tokens_can_be_sampled(request_id, prepared)
        for cls in self.processor_classes:
            cls.validate_params(prepared, vocab)
        self._check_runner_supports(request_id, prepared)
        if prepared.structured_outputs is not None:
            self._check_structured_outputs(request_id, prepared)
        return prepared

    def _resolve_thinking_end(self, request_id: str, params: SamplingParams) -> None:
        """A thinking budget without end ids ends the thinking with `</think>` as this model's tokenizer writes it."""
        if params.thinking_token_budget is None or params.thinking_end_token_ids is not None:
            return
        tokenizer = self.loaded.tokenizer
        ids = list(tokenizer.encode(THINK_END)) if tokenizer is not None else []
        if not ids:
            raise InvalidRequestError(
                f"request '{request_id}': SamplingParams.thinking_token_budget needs the end-of-thinking tokens: "
                f"this model has no tokenizer to write {THINK_END!r}; pass SamplingParams.thinking_end_token_ids"
            )
        params.thinking_end_token_ids = ids

    def _check_allowed_tokens_can_be_sampled(self, request_id: str, params: SamplingParams) -> None:
        """`allowed_token_ids` that other fields exclude entirely would leave nothing to sample at the first
        step: refuse them here, naming both fields, instead of failing the request mid-run."""
        if not params.allowed_token_ids:
            return
        allowed = set(params.allowed_token_ids)
        banned = {word[0] for word in params.bad_words_token_ids if len(word) == 1}
        if allowed <= banned:
            raise InvalidRequestError(
                f"request '{request_id}': SamplingParams.allowed_token_ids {sorted(allowed)} are all banned by "
                "SamplingParams.bad_words: no token could be sampled"
            )
        if params.min_tokens > 0:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos and self.loaded.eos_token_id is not None:
                stops |= {self.loaded.eos_token_id, *self.loaded.extra_eos_token_ids}
            if allowed <= stops | banned:
                raise InvalidRequestError(
                    f"request '{request_id}': SamplingParams.allowed_token_ids {sorted(allowed)} are all stop "
                    f"tokens (SamplingParams.stop_token_ids or eos) or bad_words, which "
                    f"SamplingParams.min_tokens={params.min_tokens} forbids before that many tokens: no token "
                    "could be sampled"
                )

    def _check_structured_outputs(self, request_id: str, params: SamplingParams) -> None:
        """Compile the grammar now (cached), so a malformed schema, regex or grammar is refused by name."""
        if self.config.parallel.world_size > 1:
            raise InvalidRequestError(
                f"request '{request_id}': SamplingParams.structured_outputs is not supported "
                "under tensor/pipeline parallelism yet"
            )
        backend = self.runner.grammar_backend  # type: ignore[attr-defined]
        try:
            backend.check(params.structured_outputs)
        except InvalidRequestError as err:
            raise InvalidRequestError(f"request '{request_id}': {err}") from None
        if params.min_tokens > 0 and not params.ignore_eos:
            self._check_grammar_meets_min_tokens(request_id, params, backend)

    @staticmethod
    def _check_grammar_meets_min_tokens(request_id: str, params: SamplingParams, backend: Any) -> None:
        """min_tokens forbids end of sequence, the only token a grammar that has ended allows: refuse a request
        whose longest output, the longest thinking before the grammar starts (a thinking budget gates the grammar
        to the answer: at most the budget plus the forced end-of-thinking tokens) plus the grammar's longest
        answer, is shorter than min_tokens. One whose min_tokens the longest thinking plus answer can meet runs."""
        end_ids = params.thinking_end_token_ids or []
        budget = params.thinking_token_budget
        thinking = budget + len(end_ids) if budget is not None and end_ids else 0
        answer_min = params.min_tokens - thinking
        if answer_min <= 0 or backend.can_run_for(params.structured_outputs, answer_min) is not False:
            return
        kind = params.structured_outputs.kind  # type: ignore[union-attr]
        after = (
            f" after the longest thinking SamplingParams.thinking_token_budget={budget} allows ({budget} tokens and "
            f"{len(end_ids)} forced end-of-thinking tokens)"
            if thinking
            else ""
        )
        raise InvalidRequestError(
            f"request '{request_id}': SamplingParams.structured_outputs.{kind} always ends before "
            f"SamplingParams.min_tokens={params.min_tokens} tokens{after} (the grammar has no longer output), and "
            "min_tokens forbids ending sooner: lower min_tokens or loosen the grammar"
        )

    def check_encoder_input(self, request_id: str, encoder_input: Optional[EncoderInput]) -> None:
        """Audio goes to encoder-decoder models only, and they need it."""
        arch = type(self.loaded.model).__name__
        where = f"request '{request_id}': " if request_id else ""
        if self.audio is None:
            if encoder_input is not None:
                raise InvalidRequestError(
                    f"{where}audio / encoder input needs an encoder-decoder model such as "
                    f"Whisper; this model ({arch}) takes text or token ids"
                )
            return
        if encoder_input is None:
            g = self.audio.geometry
            raise InvalidRequestError(
                f"{where}this model ({arch}) is an encoder-decoder speech model: "
                f"{audio_prompt_help(g.num_mel_bins, g.num_mel_frames)}"
            )
        try:
            self.audio.check_features(encoder_input.features)
        except InvalidRequestError as err:
            raise InvalidRequestError(f"{where}{err}") from None

    def validate_pooling(self, request_id: str, params: PoolingParams) -> PoolingParams:
        """Check an embedding request's parameters; returns a copy with the pooling type resolved."""
        if self.audio is not None:
            raise InvalidRequestError(
                f"request '{request_id}': embeddings need a decoder-only text model; this model "
                f"({type(self.loaded.model).__name__}) is an encoder-decoder speech model: "
                "transcribe with LLM.generate"
            )
        try:
            params.validate(hidden_size_of(self.loaded))
        except InvalidRequestError as err:
            raise InvalidRequestError(f"request '{request_id}': {err}") from None
        return dataclasses.replace(params, pooling_type=params.pooling_type or self.config.model.pooling)

    def _check_runner_supports(self, request_id: str, params: SamplingParams) -> None:
        """The V1 runner samples with temperature, top-k/top-p, min-p and seed only: refuse what it would ignore."""
        if self.full_sampler:
            return
        used = [
            name
            for name, on in (
                ("presence_penalty", params.presence_penalty != 0.0),
                ("frequency_penalty", params.frequency_penalty != 0.0),
                ("repetition_penalty", params.repetition_penalty != 1.0),
                ("logit_bias", bool(params.logit_bias)),
                ("allowed_token_ids", params.allowed_token_ids is not None),
                ("bad_words", bool(params.bad_words)),
                ("min_tokens", params.min_tokens > 0),
                ("logprobs", params.logprobs is not None),
                ("prompt_logprobs", params.prompt_logprobs is not None),
                ("structured_outputs", params.structured_outputs is not None),
                ("thinking_token_budget", params.thinking_token_budget is not None),
            )
            if on
        ]
        if used:
            raise InvalidRequestError(
                f"request '{request_id}': the V1 runner does not apply SamplingParams "
                f"{', '.join(used)}; use runner=v2 or runner=auto"
            )
