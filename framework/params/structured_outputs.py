"""Structured outputs: what a request's output must match (vLLM's `StructuredOutputsParams`), and the OpenAI
request fields (`response_format`, the extra body field `structured_outputs`) turned into it.

Plain data only: compiling the grammar needs the model's tokenizer and happens in the engine
(`samplers.structured.backend`), which also refuses a malformed schema, regex or grammar by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Union

from framework.params.request_errors import InvalidRequestError

StructuredKind = Literal["json", "regex", "choice", "grammar", "json_object"]
KINDS: tuple[StructuredKind, ...] = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint per request, with vLLM's names.

    - `json`: a JSON schema (a dict, or its JSON text); the output is one JSON value valid under it.
    - `regex`: the whole output matches this regular expression.
    - `choice`: the output is exactly one of these strings.
    - `grammar`: a Lark grammar (llguidance's dialect, `start:` rule first; EBNF in Lark syntax).
    - `json_object`: `True` = any JSON object (OpenAI's `{"type": "json_object"}`).

    Whitespace between JSON tokens (JSON only): by default at most one space (`{"a": 1, "b": [2]}`), never a run
    of spaces or newlines, so the output always closes: a model that has not learnt JSON (a small one at a high
    temperature) would otherwise spend `max_tokens` on whitespace. `whitespace_flexible`: any JSON whitespace
    (vLLM's default). `disable_any_whitespace`: none at all (`{"a":1}`).
    """

    json: Union[None, str, dict[str, Any]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> StructuredKind:
        """Which constraint is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self, where: str = "SamplingParams.structured_outputs") -> None:
        """Check the shape (exactly one constraint, each of the right type); `where` prefixes the field names.

        The content (is the schema a schema, does the regex parse) is checked when the engine compiles it.
        """
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidRequestError(
                f"{where}: exactly one of {', '.join(KINDS)} must be set (got "
                f"{', '.join(chosen) if chosen else 'none'})"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    decoded = json.loads(self.json)
                except ValueError as err:
                    raise InvalidRequestError(f"{where}.json is not valid JSON text: {err}") from None
                if not isinstance(decoded, (dict, bool)):
                    raise InvalidRequestError(
                        f"{where}.json must be a JSON schema (an object), got {type(decoded).__name__}"
                    )
            elif not isinstance(self.json, dict):
                raise InvalidRequestError(
                    f"{where}.json must be a JSON schema: a dict or its JSON text, got {type(self.json).__name__}"
                )
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidRequestError(f"{where}.regex must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise InvalidRequestError(f"{where}.choice must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidRequestError(f"{where}.grammar must be a non-empty grammar text")
        if self.json_object not in (None, True, False):
            raise InvalidRequestError(f"{where}.json_object must be true (or unset)")
        for name in ("disable_any_whitespace", "whitespace_flexible"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{where}.{name} must be true or false")
        if self.disable_any_whitespace and self.whitespace_flexible:
            raise InvalidRequestError(f"{where}: disable_any_whitespace and whitespace_flexible exclude each other")

    @property
    def whitespace(self) -> Literal["none", "one", "any"]:
        """Whitespace allowed between JSON tokens: none, at most one space (the default), or any."""
        return "none" if self.disable_any_whitespace else "any" if self.whitespace_flexible else "one"

    def cache_key(self) -> tuple[str, str, str]:
        """(kind, canonical text, whitespace): equal keys compile to the same grammar."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            text = json.dumps(list(value))
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, self.whitespace


_EXTRA_BODY_KEYS = {f.name for f in fields(StructuredOutputsParams)}


def structured_outputs_from_openai(
    response_format: Optional[dict[str, Any]], structured_outputs: Optional[dict[str, Any]]
) -> Optional[StructuredOutputsParams]:
    """The constraint of an OpenAI-style request, or None for free text.

    `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
    `structured_outputs`: vLLM's extra body field, a dict with one of `json`, `regex`, `choice`, `grammar`,
    `json_object` (and optionally `disable_any_whitespace` or `whitespace_flexible`). Both at once are refused.
    Raises `InvalidRequestError` naming the request field that is wrong.
    """
    from_format = _from_response_format(response_format)
    from_extra = _from_extra_body(structured_outputs)
    if from_format is not None and from_extra is not None:
        raise InvalidRequestError("response_format and structured_outputs are both set: give one of them")
    return from_format if from_format is not None else from_extra


def _from_response_format(response_format: Optional[dict[str, Any]]) -> Optional[StructuredOutputsParams]:
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidRequestError("response_format must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", spec.get("json_schema"))  # OpenAI's key, and vLLM's Python name
        if schema is None:
            raise InvalidRequestError("response_format.json_schema.schema is missing")
        return _build({"json": schema}, "response_format.json_schema", {"json": "schema"})
    raise InvalidRequestError(
        f"response_format.type={kind!r} is invalid: must be 'text', 'json_object' or 'json_schema'"
    )


def _from_extra_body(structured_outputs: Optional[dict[str, Any]]) -> Optional[StructuredOutputsParams]:
    if structured_outputs is None:
        return None
    if not isinstance(structured_outputs, dict):
        raise InvalidRequestError('structured_outputs must be an object (e.g. {"regex": "[0-9]+"})')
    unknown = sorted(set(structured_outputs) - _EXTRA_BODY_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs.{unknown[0]} is not supported: the fields are {', '.join(sorted(_EXTRA_BODY_KEYS))}"
        )
    return _build(dict(structured_outputs), "structured_outputs", {})


def _build(values: dict[str, Any], where: str, renamed: dict[str, str]) -> StructuredOutputsParams:
    """Construct and validate, reporting errors under the request's field names (`renamed`: ours -> theirs)."""
    params = StructuredOutputsParams.__new__(StructuredOutputsParams)
    for f in fields(StructuredOutputsParams):
        setattr(params, f.name, values.get(f.name, f.default))
    try:
        params.validate(where)
    except InvalidRequestError as err:
        message = str(err)
        for ours, theirs in renamed.items():
            message = message.replace(f"{where}.{ours}", f"{where}.{theirs}")
        raise InvalidRequestError(message) from None
    return params
