"""StructuredOutputsParams validation and the OpenAI request fields turned into it (pure functions)."""

from __future__ import annotations

import pytest

from framework import InvalidRequestError, SamplingParams, StructuredOutputsParams, structured_outputs_from_openai

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        ({"json": SCHEMA}, "json"),
        ({"json": '{"type": "integer"}'}, "json"),
        ({"regex": "[0-9]+"}, "regex"),
        ({"choice": ["yes", "no"]}, "choice"),
        ({"grammar": 'start: "a"+'}, "grammar"),
        ({"json_object": True}, "json_object"),
    ],
)
def test_each_kind_is_accepted(kwargs, kind) -> None:
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == kind
    assert SamplingParams(structured_outputs=params).structured_outputs is params


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object must be set (got none)"),
        ({"regex": "a", "choice": ["b"]}, "(got regex, choice)"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON text"),
        ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema (an object), got list"),
        ({"json": 5}, "structured_outputs.json must be a JSON schema: a dict or its JSON text, got int"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 3]}, "structured_outputs.choice must be a non-empty list"),
        ({"grammar": "   "}, "structured_outputs.grammar must be a non-empty grammar text"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
        ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be true or false"),
    ],
)
def test_bad_shapes_are_refused_by_name(kwargs, message) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_refuses_other_types() -> None:
    with pytest.raises(
        InvalidRequestError, match="SamplingParams.structured_outputs=.* None or a StructuredOutputsParams"
    ):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


def test_cache_key_is_canonical() -> None:
    a = StructuredOutputsParams(json={"b": 1, "type": "object"})
    b = StructuredOutputsParams(json='{"type": "object", "b": 1}')
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != StructuredOutputsParams(json=b.json, disable_any_whitespace=True).cache_key()
    assert StructuredOutputsParams(choice=["a", "b"]).cache_key() != StructuredOutputsParams(choice=["ab"]).cache_key()


# ---- OpenAI request fields ---------------------------------------------------------------------------------
def test_free_text() -> None:
    assert structured_outputs_from_openai(None, None) is None
    assert structured_outputs_from_openai({"type": "text"}, None) is None


def test_response_format_json_object_and_schema() -> None:
    assert structured_outputs_from_openai({"type": "json_object"}, None) == StructuredOutputsParams(json_object=True)
    got = structured_outputs_from_openai(
        {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}}, None
    )
    assert got == StructuredOutputsParams(json=SCHEMA)


@pytest.mark.parametrize(
    "extra",
    [
        {"json": SCHEMA},
        {"regex": "[a-z]+"},
        {"choice": ["x", "y"]},
        {"grammar": 'start: "a"'},
        {"json": SCHEMA, "disable_any_whitespace": True},
    ],
)
def test_extra_body_fields(extra) -> None:
    assert structured_outputs_from_openai(None, extra) == StructuredOutputsParams(**extra)


@pytest.mark.parametrize(
    "response_format, extra, message",
    [
        ("json", None, "response_format must be an object"),
        ({"type": "xml"}, None, "response_format.type='xml' is invalid"),
        ({}, None, "response_format.type=None is invalid"),
        ({"type": "json_schema"}, None, "response_format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, None, "response_format.json_schema.schema is missing"),
        (
            {"type": "json_schema", "json_schema": {"schema": 3}},
            None,
            "response_format.json_schema.schema must be a JSON",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": "{oops"}},
            None,
            "response_format.json_schema.schema is not valid JSON text",
        ),
        (None, ["regex"], "structured_outputs must be an object"),
        (None, {"regexp": "a"}, "structured_outputs.regexp is not supported"),
        (None, {}, "structured_outputs: exactly one of"),
        (None, {"regex": "a", "grammar": "start: a"}, "structured_outputs: exactly one of .* \\(got regex, grammar\\)"),
        (None, {"choice": "abc"}, "structured_outputs.choice must be a non-empty list"),
        ({"type": "json_object"}, {"regex": "a"}, "response_format and structured_outputs are both set"),
    ],
)
def test_bad_openai_fields_are_refused_by_name(response_format, extra, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        structured_outputs_from_openai(response_format, extra)
