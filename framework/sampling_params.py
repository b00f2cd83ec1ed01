"""Per-request sampling parameters, with vLLM's field names."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

from framework.request_errors import InvalidRequestError
from framework.structured_outputs import StructuredOutputsParams

OutputKind = Literal["final_only", "delta", "cumulative"]
OUTPUT_KINDS = ("final_only", "delta", "cumulative")
MAX_N = 128  # parallel sampling: the most sequences one request may ask for


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
    detokenized text (cut before the match unless `include_stop_str_in_output`).

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
    max_tokens: int = 16
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
        """A fast sufficient test for `_check_fields` passing: every field of its exact plain type, in range,
        and the optional lists and dicts absent. False sends the parameters to the full checks (which may still
        accept them: stop strings, logit bias, ...); True never accepts what they would refuse."""
        num = (int, float)
        t, top_p, min_p = self.temperature, self.top_p, self.min_p
        pres, freq, rep = self.presence_penalty, self.frequency_penalty, self.repetition_penalty
        lp, plp = self.logprobs, self.prompt_logprobs
        return (
            type(self.n) is int and 1 <= self.n <= MAX_N
            and type(t) in num and type(top_p) in num and type(min_p) in num
            and type(pres) in num and type(freq) in num and type(rep) in num
            and t >= 0.0 and t != math.inf and 0.0 < top_p <= 1.0 and 0.0 <= min_p <= 1.0
            and type(self.top_k) is int and self.top_k >= -1
            and (self.seed is None or type(self.seed) is int)
            and type(self.max_tokens) is int and self.max_tokens >= 1
            and type(self.min_tokens) is int and 0 <= self.min_tokens <= self.max_tokens
            and (lp is None or (type(lp) is int and lp >= 0)) and (plp is None or (type(plp) is int and plp >= 0))
            and -2.0 <= pres <= 2.0 and -2.0 <= freq <= 2.0 and 0.0 < rep < 1e300  # (larger: the full check)
            and type(self.stop_token_ids) is list and not self.stop_token_ids and self.stop is None
            and type(self.include_stop_str_in_output) is bool and type(self.ignore_eos) is bool
            and type(self.detokenize) is bool and type(self.skip_special_tokens) is bool
            and self.logit_bias is None and self.allowed_token_ids is None and self.bad_words is None
            and self.output_kind in OUTPUT_KINDS and self.extra_args is None and self.structured_outputs is None
        )

    def _check_fields(self) -> None:
        """The field-by-field checks of `validate`, in field order: the first invalid field is named."""

        def bad(name: str, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: must be {allowed}")

        def check_int(name: str, lo: Optional[int] = None, allowed: str = "an integer", optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if not _is_int(value) or (lo is not None and value < lo):
                raise bad(name, allowed)

        def check_bool(name: str) -> None:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")

        check_int("n", 1, "an integer >= 1")
        if self.n > MAX_N:
            raise bad("n", f"in [1, {MAX_N}]")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not _is_number(getattr(self, name)):
                raise bad(name, "a number")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise bad("temperature", ">= 0 and finite (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "in (0, 1]")
        check_int("top_k", -1, "-1 or 0 (disabled) or a positive integer")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "in [0, 1]")
        check_int("seed", None, "None or an integer", optional=True)
        check_int("max_tokens", 1, ">= 1")
        check_int("min_tokens", 0, "in [0, max_tokens]")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "in [0, max_tokens]")
        check_int("logprobs", 0, "None or >= 0", optional=True)
        check_int("prompt_logprobs", 0, "None or >= 0", optional=True)
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", "in [-2, 2]")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", "in [-2, 2]")
        if not (self.repetition_penalty > 0.0) or not math.isfinite(self.repetition_penalty):
            raise bad("repetition_penalty", "> 0 and finite")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(not _is_int(t) or t < 0
                                                                     for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or any(not isinstance(s, str) or not s for s in self.stop)):
            raise bad("stop", "None, a non-empty string or a list of non-empty strings")
        for name in ("include_stop_str_in_output", "ignore_eos", "detokenize", "skip_special_tokens"):
            check_bool(name)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                not _is_int(k) or k < 0 or not _is_number(v) or not math.isfinite(v)
                for k, v in self.logit_bias.items()
            ):
                raise bad("logit_bias", "a dict of non-negative token id -> finite float")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or any(not _is_int(t) or t < 0 for t in ids):
                raise bad("allowed_token_ids", "None or a non-empty list of non-negative token ids")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(not _valid_bad_word(w) for w in self.bad_words):
                raise bad("bad_words", "a list of non-empty strings or non-empty lists of non-negative token ids")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", " or ".join(repr(k) for k in OUTPUT_KINDS))
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "None or a dict")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "None or a StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.stop and not self.detokenize:
            raise bad("stop", "empty when detokenize=False (stop strings are matched on the text)")

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


def _valid_bad_word(word: Any) -> bool:
    if isinstance(word, str):
        return bool(word.strip())
    return (isinstance(word, (list, tuple)) and len(word) > 0
            and all(_is_int(t) and t >= 0 for t in word))


def first_invalid_token_index(ids: Sequence[Any], vocab_size: int) -> Optional[int]:
    """The index of the first item of `ids` that is not a token id in [0, vocab_size) (a bool or None is not
    one), or None when every item is one.

    Checked at C speed when every item is an int (one pass for the types, one for min, one for max); the item
    is looked for one by one only when that check fails. An index, not the item: the item may be None."""
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return None
    return next((i for i, t in enumerate(ids) if not (_is_int(t) and 0 <= t < vocab_size)), None)


def first_out_of_vocab(ids: Sequence[int], vocab_size: int) -> Optional[int]:
    """The first id outside [0, vocab_size), or None."""
    return next((t for t in ids if not (0 <= t < vocab_size)), None)
