"""Per-request sampling parameters, with vLLM's field names, and the checks `SamplingParams.validate` runs: the
flat fast test and the field-by-field checks that name the first invalid field, and the token-id checks of
prompts and parameters."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

from framework.params.request_errors import InvalidRequestError
from framework.params.structured_outputs import StructuredOutputsParams

OutputKind = Literal["final_only", "delta", "cumulative"]
OUTPUT_KINDS = ("final_only", "delta", "cumulative")
MAX_N = 128  # parallel sampling: the most sequences one request may ask for
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # the sampler keeps seeds in an int64 table
THINK_END = "</think>"  # the end-of-thinking text tokenised when `thinking_end_token_ids` is not given


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def plainly_valid(params: "SamplingParams") -> bool:
    """A fast sufficient test for `check_fields` passing: every field of its exact plain type, in range, and
    the optional lists and dicts absent. False sends the parameters to the full checks (which may still accept
    them: stop strings, logit bias, ...); True never accepts what they would refuse."""
    num = (int, float)
    t, top_p, min_p = params.temperature, params.top_p, params.min_p
    pres, freq, rep = params.presence_penalty, params.frequency_penalty, params.repetition_penalty
    lp, plp = params.logprobs, params.prompt_logprobs
    return (
        type(params.n) is int
        and 1 <= params.n <= MAX_N
        and type(t) in num
        and type(top_p) in num
        and type(min_p) in num
        and type(pres) in num
        and type(freq) in num
        and type(rep) in num
        and t >= 0.0
        and t != math.inf
        and 0.0 < top_p <= 1.0
        and 0.0 <= min_p <= 1.0
        and type(params.top_k) is int
        and params.top_k >= -1
        and (params.seed is None or (type(params.seed) is int and SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]))
        and (params.max_tokens is None or (type(params.max_tokens) is int and params.max_tokens >= 1))
        and type(params.min_tokens) is int
        and 0 <= params.min_tokens
        and (params.max_tokens is None or params.min_tokens <= params.max_tokens)
        and (lp is None or (type(lp) is int and lp >= 0))
        and (plp is None or (type(plp) is int and plp >= 0))
        and -2.0 <= pres <= 2.0
        and -2.0 <= freq <= 2.0
        and 0.0 < rep < 1e300  # (larger: the full check)
        and type(params.stop_token_ids) is list
        and not params.stop_token_ids
        and params.stop is None
        and type(params.include_stop_str_in_output) is bool
        and type(params.ignore_eos) is bool
        and type(params.detokenize) is bool
        and type(params.skip_special_tokens) is bool
        and params.logit_bias is None
        and params.allowed_token_ids is None
        and params.bad_words is None
        and params.output_kind in OUTPUT_KINDS
        and params.extra_args is None
        and params.structured_outputs is None
        and params.thinking_token_budget is None
        and params.thinking_end_token_ids is None
    )


def check_fields(params: "SamplingParams") -> None:
    """The field-by-field checks of `SamplingParams.validate`, in field order: raise `InvalidRequestError`
    naming the first invalid field."""

    def bad(name: str, allowed: str) -> InvalidRequestError:
        return InvalidRequestError(f"SamplingParams.{name}={getattr(params, name)!r} is invalid: must be {allowed}")

    def check_int(name: str, lo: Optional[int] = None, allowed: str = "an integer", optional: bool = False) -> None:
        value = getattr(params, name)
        if optional and value is None:
            return
        if not _is_int(value) or (lo is not None and value < lo):
            raise bad(name, allowed)

    def check_bool(name: str) -> None:
        if not isinstance(getattr(params, name), bool):
            raise bad(name, "True or False")

    check_int("n", 1, "an integer >= 1")
    if params.n > MAX_N:
        raise bad("n", f"in [1, {MAX_N}]")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not _is_number(getattr(params, name)):
            raise bad(name, "a number")
    if not (params.temperature >= 0.0) or params.temperature == float("inf"):
        raise bad("temperature", ">= 0 and finite (0 = greedy)")
    if not (0.0 < params.top_p <= 1.0):
        raise bad("top_p", "in (0, 1]")
    check_int("top_k", -1, "-1 or 0 (disabled) or a positive integer")
    if not (0.0 <= params.min_p <= 1.0):
        raise bad("min_p", "in [0, 1]")
    check_int("seed", None, "None or an integer", optional=True)
    if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
        raise bad("seed", "None or an integer in [-2**63, 2**63 - 1]")
    check_int("max_tokens", 1, "None (what the context leaves) or >= 1", optional=True)
    check_int("min_tokens", 0, "in [0, max_tokens]")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise bad("min_tokens", "in [0, max_tokens]")
    check_int("logprobs", 0, "None or >= 0", optional=True)
    check_int("prompt_logprobs", 0, "None or >= 0", optional=True)
    if not (-2.0 <= params.presence_penalty <= 2.0):
        raise bad("presence_penalty", "in [-2, 2]")
    if not (-2.0 <= params.frequency_penalty <= 2.0):
        raise bad("frequency_penalty", "in [-2, 2]")
    if not (params.repetition_penalty > 0.0) or not math.isfinite(params.repetition_penalty):
        raise bad("repetition_penalty", "> 0 and finite")
    if not isinstance(params.stop_token_ids, (list, tuple)) or any(
        not _is_int(t) or t < 0 for t in params.stop_token_ids
    ):
        raise bad("stop_token_ids", "a list of non-negative token ids")
    if params.stop is not None and (
        not isinstance(params.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in params.stop)
    ):
        raise bad("stop", "None, a non-empty string or a list of non-empty strings")
    for name in ("include_stop_str_in_output", "ignore_eos", "detokenize", "skip_special_tokens"):
        check_bool(name)
    if params.logit_bias is not None:
        if not isinstance(params.logit_bias, dict) or any(
            not _is_int(k) or k < 0 or not _is_number(v) or not math.isfinite(v) for k, v in params.logit_bias.items()
        ):
            raise bad("logit_bias", "a dict of non-negative token id -> finite float")
    if params.allowed_token_ids is not None:
        ids = params.allowed_token_ids
        if not isinstance(ids, (list, tuple)) or not ids or any(not _is_int(t) or t < 0 for t in ids):
            raise bad("allowed_token_ids", "None or a non-empty list of non-negative token ids")
    if params.bad_words is not None:
        if not isinstance(params.bad_words, (list, tuple)) or any(not _valid_bad_word(w) for w in params.bad_words):
            raise bad("bad_words", "a list of non-empty strings or non-empty lists of non-negative token ids")
    if params.output_kind not in OUTPUT_KINDS:
        raise bad("output_kind", " or ".join(repr(k) for k in OUTPUT_KINDS))
    if params.extra_args is not None and not isinstance(params.extra_args, dict):
        raise bad("extra_args", "None or a dict")
    if params.structured_outputs is not None:
        if not isinstance(params.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "None or a StructuredOutputsParams")
        params.structured_outputs.validate()
    check_int("thinking_token_budget", 0, "None or >= 0", optional=True)
    end_ids = params.thinking_end_token_ids
    if end_ids is not None and (
        not isinstance(end_ids, (list, tuple)) or not end_ids or any(not _is_int(t) or t < 0 for t in end_ids)
    ):
        raise bad("thinking_end_token_ids", "None or a non-empty list of non-negative token ids")
    if params.stop and not params.detokenize:
        raise bad("stop", "empty when detokenize=False (stop strings are matched on the text)")


def _valid_bad_word(word: Any) -> bool:
    if isinstance(word, str):
        return bool(word.strip())
    return isinstance(word, (list, tuple)) and len(word) > 0 and all(_is_int(t) and t >= 0 for t in word)


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


__all__ = [
    "MAX_N",
    "OUTPUT_KINDS",
    "InvalidRequestError",
    "OutputKind",
    "SamplingParams",
    "first_invalid_token_index",
    "first_out_of_vocab",
]


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

    Thinking: `thinking_token_budget` ends a reasoning model's thinking section after that many output tokens
    by forcing `thinking_end_token_ids` (None: the engine tokenises `</think>`) unless the output already holds
    them; see the "Tool calling and reasoning" page.

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
    thinking_token_budget: Optional[int] = None
    thinking_end_token_ids: Optional[list[int]] = None
    # Set by the engine from `bad_words` with the request's tokenizer (see `EngineCore.add_request`).
    _bad_words_token_ids: Optional[list[list[int]]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            # JSON object keys are strings: accept "123" like vLLM does.
            self.logit_bias = {
                int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in self.logit_bias.items()
            }
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
        """The flat fast test (`plainly_valid` below)."""
        return plainly_valid(self)

    def _check_fields(self) -> None:
        """The field-by-field checks (`check_fields` below)."""
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
