"""Check command-line overrides against the config tree and the schema before Hydra composes anything.

Hydra alone would say "Key 'temprature' is not in struct"; this says which keys exist and which is closest.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel

from framework.config.base import ConfigError
from framework.config.retired import retired_message
from framework.config.schema import Mrv2Config


def group_options(conf_dir: Path, group: str) -> list[str]:
    """Options of a config group: the YAML files of `conf/<group>/`."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def _close(word: str, options: Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _check_key(dotted: str) -> None:
    retired = retired_message(dotted)
    if retired is not None:
        raise ConfigError(f"invalid config:\n  {retired}")
    model: type[BaseModel] = Mrv2Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(
                f"invalid config:\n  {dotted}: unknown key{_close(part, fields)}; allowed keys at {where}: "
                f"{', '.join(sorted(fields))}"
            )
        annotation = fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            if i < len(parts) - 1:
                raise ConfigError(f"invalid config:\n  {dotted}: '{'.'.join(parts[: i + 1])}' has no sub-keys")
            return
        model = annotation


def _choices(value: Any) -> list[str]:
    """The option names an override selects (several for a multirun sweep like `model=a,b`)."""
    from hydra.core.override_parser.types import ChoiceSweep

    if isinstance(value, ChoiceSweep):
        return [str(v) for v in value.list]
    return [str(value)]


def check_overrides(overrides: list[str], conf_dir: Path) -> None:
    """Raise `ConfigError` for an unknown key or group option among `overrides`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = sorted(p.name for p in conf_dir.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__"))
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # Hydra's grammar errors are readable; re-raise them as ours
        raise ConfigError(f"invalid override: {err}") from None
    for ov in parsed:
        key = ov.key_or_group
        if key.startswith("hydra") or ov.is_delete():
            continue
        if key in groups:
            options = group_options(conf_dir, key)
            for choice in _choices(ov.value()):
                if choice not in options and choice != "null":
                    raise ConfigError(
                        f"invalid config:\n  {key}={choice}: unknown option{_close(choice, options)}; "
                        f"available {key} options: {', '.join(options)}"
                    )
        elif "/" not in key:
            _check_key(key)
