"""`SamplingParams.validate`'s flat fast test never accepts what the field-by-field checks refuse.

Parameters are built valid, then fields are overwritten with values from a pool of valid, edge and invalid
values (bools for ints, NaN, inf, huge ints, int subclasses, empty and non-empty containers, wrong types),
one, two or three fields at a time. For each, `validate()` must end exactly as `_check_fields()` does
(the same exception type and message, or none), and `_plainly_valid()` must imply `_check_fields()` passes.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from framework.params.request_errors import InvalidRequestError
from framework.params.sampling_params import SamplingParams
from framework.params.structured_outputs import StructuredOutputsParams


class _Int(int):
    """An int subclass: `_is_int` accepts it, the fast test's exact-type check does not."""


NUMBERS = [
    0,
    1,
    0.0,
    0.5,
    1.0,
    1.5,
    -0.5,
    -1,
    -2.0,
    2.0,
    2.5,
    -3,
    math.nan,
    math.inf,
    -math.inf,
    True,
    False,
    10**400,
    _Int(1),
    None,
    "1",
    128,
    129,
    200,
]
POOL: dict[str, list[Any]] = {
    "n": [1, 2, 128, 129, 0, -1, True, 1.0, _Int(2), None],
    "temperature": NUMBERS,
    "top_p": NUMBERS,
    "min_p": NUMBERS,
    "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS,
    "repetition_penalty": NUMBERS,
    "top_k": [0, -1, -2, 5, 1 << 40, True, 1.0, _Int(3), None],
    "seed": [None, 0, -5, (1 << 63) - 1, -(1 << 63), 1 << 63, -(1 << 63) - 1, 1 << 70, True, 1.5, _Int(4), "7"],
    "max_tokens": [1, 16, 0, -1, True, 2.0, _Int(5), None],
    "min_tokens": [0, 1, 16, 17, -1, True, 0.0, _Int(0)],
    "thinking_token_budget": [None, 0, 8, -1, True, 1.5],
    "thinking_end_token_ids": [None, [5], [1, 2], [], [-1], [True], (3,)],
    "logprobs": [None, 0, 5, -1, True, 1.0, _Int(2)],
    "prompt_logprobs": [None, 0, 5, -1, False, 1.0],
    "stop": [None, [], ["x"], "", [""], [1], ("a",)],
    "stop_token_ids": [[], [1, 2], [-1], [True], (), (3,), None, [1.0]],
    "include_stop_str_in_output": [False, True, 0, 1, None],
    "ignore_eos": [False, True, 0, None],
    "detokenize": [True, False, 1],
    "skip_special_tokens": [True, False, "yes"],
    "logit_bias": [None, {}, {1: 0.5}, {-1: 0.0}, {1: math.nan}, [1]],
    "allowed_token_ids": [None, [], [1], [-1], (2,)],
    "bad_words": [None, [], ["a"], [[1, 2]], [[]], [" "]],
    "output_kind": ["final_only", "delta", "cumulative", "all", None],
    "extra_args": [None, {}, {"k": 1}, [1]],
    "structured_outputs": [None, StructuredOutputsParams(regex="a+"), "json"],
}


def _outcome(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the comparison is of whatever either path raises
        return type(err).__name__, str(err)
    return None


def test_the_pool_names_every_field() -> None:
    fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert fields == set(POOL)


def test_fast_test_agrees_with_the_field_checks() -> None:
    rng = random.Random(0)
    accepted_fast = refused = 0
    for _ in range(6000):
        params = SamplingParams(max_tokens=16)
        for name in rng.sample(sorted(POOL), rng.choice([1, 1, 2, 3])):
            setattr(params, name, rng.choice(POOL[name]))
        full = _outcome(params._check_fields)
        if params._plainly_valid():
            assert full is None, (params, full)
            accepted_fast += 1
        assert _outcome(params.validate) == full, params
        refused += full is not None
    # Both sides are exercised: many plain parameters take the fast path, many invalid ones are refused.
    assert accepted_fast > 500 and refused > 1500


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": math.nan},
        {"n": True},
        {"max_tokens": 1.0},
        {"min_tokens": 17},
        {"output_kind": "all"},
        {"top_p": 0.0},
        {"seed": 1 << 63},
    ],
)  # the sampler's seed table is int64
def test_a_caller_edit_after_construction_is_still_refused(changes: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=16)
    for name, value in changes.items():
        setattr(params, name, value)
    with pytest.raises(InvalidRequestError, match=f"SamplingParams.{next(iter(changes))}="):
        params.validate()
