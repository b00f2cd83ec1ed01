"""Per-request sampling parameters, with vLLM's field names."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from framework.request_errors import InvalidRequestError
# The checks live in their own module; their public names stay importable from here too.
from framework.sampling_checks import (MAX_N, OUTPUT_KINDS, OutputKind, check_fields, first_invalid_token_index,
                                       first_out_of_vocab, plainly_valid)
from framework.structured_outputs import StructuredOutputsParams

__all__ = ["MAX_N", "OUTPUT_KINDS", "InvalidRequestError", "OutputKind", "SamplingParams", "first_invalid_token_index",
           "first_out_of_vocab"]


# Values a copy may share: immutable, so sharing them is the same as copying them.
_IMMUTABLE = frozenset({int, float, str, bool, type(None)})


def _copied(value: Any) -> Any:
    """A deep copy of one field's value; the common containers of immutable items are copied directly."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is list and all(type(item) in _IMMUTABLE for item in value):
        return list(value)
    if kind is dict and all(type(k) in _IMMUTABLE and type(v) in _IMMUTABLE for k, v in value.items()):
        return dict(value)
    return copy.deepcopy(value)


@dataclass
class SamplingParams:
    """How one request samples, what it reports and when it stops.

    Sampling: temperature 0 means greedy. top_k 0 (or -1), top_p 1 and min_p 0 disable those filters.
    A request with a `seed` draws the same tokens whatever else is in the batch: the noise is keyed by
    (seed, token position). Penalties follow vLLM: `presence_penalty` and `frequency_penalty` are subtracted
    per output token (once, and once per occurrence), `repetition_penalty` divides positive and multiplies
    negative logits of every token seen in the prompt or the output.

    Masks: `logit_bias` (token id -> value added to its logit), `allowed_token_ids` (every other token is
    excluded), `bad_words` (strings, tokenised with the request's tokenizer, or token-id sequences: the
    last token of a word is excluded when the output ends with the rest of it), `min_tokens` (stop tokens,
    eos included unless `ignore_eos`, are excluded until that many tokens were produced).

    Reporting: `logprobs` (the sampled token's logprob and rank plus that many most likely tokens),
    `prompt_logprobs` (the same for every prompt token after the first), `detokenize`,
    `skip_special_tokens`, `output_kind` ("final_only": one output when the request ends; "delta": an
    output every step with what is new; "cumulative": every step with everything so far).

    Parallel sampling: `n` sequences from one prompt (they share the prompt's KV blocks through the prefix
    cache); with a `seed`, sequence 0 uses it and sequence i > 0 a seed derived from (seed, i).

    Stopping: eos (unless `ignore_eos`), `stop_token_ids`, `max_tokens`, `stop` strings matched on the
    detokenized text (cut before the match unless `include_stop_str_in_output`; the text of a stopping eos or
    `stop_token_ids` token is likewise left out).

    Structured outputs: `structured_outputs` (a `StructuredOutputsParams`: JSON schema, regex, choice or
    grammar) restricts every sampled token to those the grammar allows; see the "Structured outputs" page.

    `extra_args` carries per-request arguments of custom logits processors (each reads its own keys).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: as many as the context leaves (max_model_len - prompt), as vLLM
    min_tokens: int = 0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[Union[str, list[int]]]] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: OutputKind = "final_only"
    extra_args: Optional[dict[str, Any]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Set by the engine from `bad_words` with the request's tokenizer (see `EngineCore.add_request`).
    _bad_words_token_ids: Optional[list[list[int]]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            # JSON object keys are strings: accept "123" like vLLM does.
            self.logit_bias = {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        self.validate()

    def clone(self) -> "SamplingParams":
        """A deep copy (the engine resolves `bad_words` on its own copy): nothing the caller changes in `self`
        afterwards reaches it. Field by field, without `copy.deepcopy`'s walk over every value (most fields are
        numbers and short lists of ids; that walk was most of the cost of an arrival)."""
        fields = dict(self.__dict__)
        for name, value in fields.items():
            if type(value) not in _IMMUTABLE:
                fields[name] = _copied(value)
        new = object.__new__(type(self))
        new.__dict__.update(fields)
        return new

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first invalid field.

        Runs twice per request (at construction, and in the engine, as the caller may have changed the object
        since): plain parameters pass one flat test (`_plainly_valid`); anything else gets the field-by-field
        checks, which also name the problem."""
        if not self._plainly_valid():
            self._check_fields()

    def _plainly_valid(self) -> bool:
        """The flat fast test (`framework.sampling_checks.plainly_valid`)."""
        return plainly_valid(self)

    def _check_fields(self) -> None:
        """The field-by-field checks (`framework.sampling_checks.check_fields`)."""
        check_fields(self)

    @property
    def is_greedy(self) -> bool:
        """True when the argmax is taken (temperature 0)."""
        return self.temperature == 0.0

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """Bad words as token-id sequences: resolved by the engine, or given as ids by the caller."""
        if self._bad_words_token_ids is not None:
            return self._bad_words_token_ids
        if not self.bad_words:
            return []
        if any(isinstance(w, str) for w in self.bad_words):
            raise InvalidRequestError("SamplingParams.bad_words holds strings: the engine must tokenise them first")
        return [list(w) for w in self.bad_words]  # type: ignore[arg-type]

    def resolve_bad_words(self, encode: Optional[Any]) -> None:
        """Tokenise string bad words with `encode(text) -> list[int]`.

        A word is excluded both at the start of the text and after a space: when the tokenizer merges a
        leading space into the first token, the spaced spelling is added as a second sequence of ids.
        """
        resolved: list[list[int]] = []
        for word in self.bad_words or []:
            if not isinstance(word, str):
                resolved.append(list(word))
                continue
            if encode is None:
                raise InvalidRequestError(
                    "SamplingParams.bad_words has strings but this model has no tokenizer: pass token-id lists"
                )
            plain = list(encode(word.lstrip()))
            if not plain:
                raise InvalidRequestError(f"SamplingParams.bad_words: {word!r} tokenises to nothing")
            resolved.append(plain)
            spaced = list(encode(" " + word.lstrip()))
            if spaced and spaced != plain and len(spaced) == len(plain) and spaced[0] != plain[0]:
                resolved.append(spaced)
        self._bad_words_token_ids = resolved

