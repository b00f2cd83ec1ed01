"""JSON that finishes: under a JSON schema the default grammar allows at most one space between tokens, so the
embedded tiny model at temperature 0.9 closes its JSON (finish reason "stop") in at least 95% of 64 seeds and
every stopped output validates; `whitespace_flexible=True` (any whitespace, vLLM's default) is the negative
control, where the same seeds run into whitespace loops."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest

from framework import SamplingParams, StructuredOutputsParams
from framework.entrypoints.llm import LLM
from framework.models.embedded import shipped_model_dir
from samplers.structured.backend import JSON_WHITESPACE

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "count", "tags"],
    "additionalProperties": False,
}
SEEDS = 64


def _run(llm: LLM, **whitespace: bool) -> list:  # type: ignore[type-arg]
    so = StructuredOutputsParams(json=SCHEMA, **whitespace)
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=64, structured_outputs=so) for s in range(SEEDS)]
    return llm.generate(["record = "] * SEEDS, params, use_tqdm=False)


@pytest.mark.skipif(shipped_model_dir("tiny") is None, reason="the trained embedded model is not in the package")
def test_json_finishes_at_temperature_0_9() -> None:
    llm = LLM("tiny", device="cpu", dtype="float32")
    outs = _run(llm)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 0.95 * SEEDS, [o.text for o in outs if o.finish_reason != "stop"][:3]
    for out in stopped:
        jsonschema.validate(json.loads(out.text), SCHEMA)
        between = re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.text)  # the text outside JSON strings
        assert "  " not in between and "\n" not in between  # never a run of whitespace
    flexible = _run(llm, whitespace_flexible=True)  # the control: the same seeds, any whitespace
    assert sum(o.finish_reason == "stop" for o in flexible) < len(stopped)


def test_one_space_grammar_accepts_one_space_and_refuses_runs() -> None:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_WHITESPACE["one"])
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    for text, ok in (
        ('{"name": "x", "count": 1, "tags": ["a"]}', True),
        ('{"name":"x","count":1,"tags":[]}', True),
        ('{"name":  "x", "count": 1, "tags": []}', False),
        ('{"name": "x",\n"count": 1, "tags": []}', False),
    ):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        consumed = matcher.try_consume_tokens(list(text.encode()))
        assert (consumed == len(text) and matcher.is_accepting()) is ok, text


class _Bytes:
    """A 257-token byte vocabulary (256 bytes and an end of sequence) for grammar checks without a model."""

    bos_token_id = None
    eos_token_id = 256
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)
