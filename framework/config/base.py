"""What every config section shares: the error type, the strict base model and the readable error message."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key and what is allowed."""


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def section_of(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The sub-model of field `name` of `model`; None for a leaf (or no such field)."""
    field = model.model_fields.get(name)
    annotation = getattr(field, "annotation", None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the sub-model at `loc` (the parent of the offending key)."""
    section: type[BaseModel] | None = model
    for part in loc[:-1]:
        assert section is not None
        section = section_of(section, str(part))
        if section is None:
            return []
    assert section is not None
    return sorted(section.model_fields)


def format_validation_error(err: ValidationError, schema: type[BaseModel]) -> str:
    """One readable line per problem: the dotted key, what is wrong, and what is allowed."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<config>"
        if e["type"] == "extra_forbidden":
            allowed = allowed_keys(schema, loc)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            lines.append(f"{key}: unknown key{hint}; allowed keys: {', '.join(allowed)}")
        else:
            value = e.get("input")
            got = "" if isinstance(value, (dict, list)) else f" (got {value!r})"  # a whole section is noise
            lines.append(f"{key}: {e['msg']}{got}")
    return "invalid config:\n  " + "\n  ".join(lines)
