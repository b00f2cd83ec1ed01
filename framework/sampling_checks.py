"""The checks `SamplingParams.validate` runs: the flat fast test and the field-by-field checks that name the
first invalid field, and the token-id checks of prompts and parameters."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence

from framework.request_errors import InvalidRequestError
from framework.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from framework.sampling_params import SamplingParams

OutputKind = Literal["final_only", "delta", "cumulative"]
OUTPUT_KINDS = ("final_only", "delta", "cumulative")
MAX_N = 128  # parallel sampling: the most sequences one request may ask for
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # the sampler keeps seeds in an int64 table


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
        type(params.n) is int and 1 <= params.n <= MAX_N
        and type(t) in num and type(top_p) in num and type(min_p) in num
        and type(pres) in num and type(freq) in num and type(rep) in num
        and t >= 0.0 and t != math.inf and 0.0 < top_p <= 1.0 and 0.0 <= min_p <= 1.0
        and type(params.top_k) is int and params.top_k >= -1
        and (params.seed is None or (type(params.seed) is int and SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]))
        and (params.max_tokens is None or (type(params.max_tokens) is int and params.max_tokens >= 1))
        and type(params.min_tokens) is int and 0 <= params.min_tokens
        and (params.max_tokens is None or params.min_tokens <= params.max_tokens)
        and (lp is None or (type(lp) is int and lp >= 0)) and (plp is None or (type(plp) is int and plp >= 0))
        and -2.0 <= pres <= 2.0 and -2.0 <= freq <= 2.0 and 0.0 < rep < 1e300  # (larger: the full check)
        and type(params.stop_token_ids) is list and not params.stop_token_ids and params.stop is None
        and type(params.include_stop_str_in_output) is bool and type(params.ignore_eos) is bool
        and type(params.detokenize) is bool and type(params.skip_special_tokens) is bool
        and params.logit_bias is None and params.allowed_token_ids is None and params.bad_words is None
        and params.output_kind in OUTPUT_KINDS and params.extra_args is None and params.structured_outputs is None
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
    if not isinstance(params.stop_token_ids, (list, tuple)) or any(not _is_int(t) or t < 0
                                                                   for t in params.stop_token_ids):
        raise bad("stop_token_ids", "a list of non-negative token ids")
    if params.stop is not None and (not isinstance(params.stop, (list, tuple))
                                    or any(not isinstance(s, str) or not s for s in params.stop)):
        raise bad("stop", "None, a non-empty string or a list of non-empty strings")
    for name in ("include_stop_str_in_output", "ignore_eos", "detokenize", "skip_special_tokens"):
        check_bool(name)
    if params.logit_bias is not None:
        if not isinstance(params.logit_bias, dict) or any(
            not _is_int(k) or k < 0 or not _is_number(v) or not math.isfinite(v)
            for k, v in params.logit_bias.items()
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
    if params.stop and not params.detokenize:
        raise bad("stop", "empty when detokenize=False (stop strings are matched on the text)")


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
