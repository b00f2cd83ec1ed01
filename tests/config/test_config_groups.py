"""The group files under conf/ hold only differences from the schema (framework/config/hydra_defaults.py).

Two rules: no group file repeats a key whose value equals the schema default, and what Hydra composes for every
option of every group (and every experiment) validates to the same config as the plain reading of the files:
the schema's defaults, updated with `conf/base.yaml`'s keys and the selected option's keys.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from framework.config.hydra_defaults import SCHEMA_DEFAULTS, register_schema_defaults
from framework.config.schema import ConfigError, Mrv2Config, load_config
from framework.entrypoints.cli import conf_dir

CONF = conf_dir()
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__", "experiment"))


def _keys(path: Path) -> dict[str, Any]:
    """A YAML file's keys, without its defaults list."""
    data = yaml.safe_load(path.read_text()) or {}
    data.pop("defaults", None)
    return data


def _defaults_list(path: Path) -> list[Any]:
    return (yaml.safe_load(path.read_text()) or {}).get("defaults") or []


def _update(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`base` updated with `new`, section by section (a list or a scalar replaces the old value)."""
    out = copy.deepcopy(base)
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _update(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def repeated_defaults(keys: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of `keys` whose value equals the schema default `defaults` holds for them."""
    repeated = []
    for key, value in keys.items():
        default = defaults.get(key, ...)
        if isinstance(value, dict) and isinstance(default, dict):
            repeated += repeated_defaults(value, default, f"{prefix}{key}.")
        elif value == default:
            repeated.append(f"{prefix}{key}")
    return repeated


def _group_files() -> Iterator[Path]:
    for group in GROUPS:
        yield from sorted((CONF / group).glob("*.yaml"))


def _experiment_layers(name: str, choices: dict[str, str]) -> list[dict[str, Any]]:
    """The global keys an experiment sets, in merge order (experiments it includes first, its own keys last);
    its `override /group: option` entries go into `choices`."""
    path = CONF / "experiment" / f"{name}.yaml"
    layers: list[dict[str, Any]] = []
    for entry in _defaults_list(path):
        if isinstance(entry, str) and entry != "_self_":
            layers += _experiment_layers(entry, choices)
        elif isinstance(entry, dict):
            for key, option in entry.items():
                assert key.startswith("override /"), (path, entry)
                choices[key.removeprefix("override /")] = option
    return [*layers, _keys(path)]


def expected_config(group: str, option: str, extra: dict[str, Any]) -> dict[str, Any]:
    """What `group=option` means read plainly: the schema's defaults, each group's selected file over its
    section, `conf/base.yaml`'s keys, the experiment's keys, then `extra` (the command line)."""
    base_entries = [entry for entry in _defaults_list(CONF / "base.yaml") if isinstance(entry, dict)]
    choices = {str(g): str(o) for entry in base_entries for g, o in entry.items()}
    layers = _experiment_layers(option, choices) if group == "experiment" else []
    if group != "experiment":
        choices[group] = option
    data = Mrv2Config().model_dump(mode="json")  # the pydantic model itself, not the registered node
    for g in GROUPS:
        data[g] = _update(data[g], _keys(CONF / g / f"{choices[g]}.yaml"))
    for layer in [_keys(CONF / "base.yaml"), *layers, extra]:
        data = _update(data, layer)
    return data


def _outcome(data: Any) -> Any:
    try:
        return load_config(data)
    except ConfigError as err:
        return str(err)


def _options() -> list[tuple[str, str]]:
    return [(g, p.stem) for g in [*GROUPS, "experiment"] for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.fixture
def draft_head(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")  # a draft head directory for the eagle / eagle3 options
    return tmp_path


def _compose(primary: str, overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name=primary, overrides=overrides)


@pytest.mark.parametrize("primary", ["run", "bench", "serve"])
@pytest.mark.parametrize("group, option", _options())
def test_composed_option_equals_schema_defaults_updated_with_its_file(primary, group, option, draft_head):
    """Without extra keys (model=hf and speculator=eagle fail alike, with the same message), and with the keys an
    option needs to run."""
    needs = {"hf": {"model": {"path": "/x"}}, "eagle": {"speculator": {"model": str(draft_head)}}}
    needs["eagle3"] = needs["eagle"]
    for extra in ({}, needs.get(option, {})):
        overrides = [f"{section}.{k}={v}" for section, keys in extra.items() for k, v in keys.items()]
        got = _outcome(_compose(primary, [f"{group}={option}", *overrides]))
        assert got == _outcome(expected_config(group, option, extra)), (primary, group, option, extra)
    assert isinstance(got, Mrv2Config), got  # with what it needs, every option runs


def test_a_drifting_schema_node_fails_the_equality(draft_head):
    """Negative control: a registered defaults node that disagrees with the pydantic model is caught."""
    from hydra.core.config_store import ConfigStore

    drifted = Mrv2Config().model_dump(mode="json")
    drifted["scheduler"]["max_num_seqs"] = 65
    ConfigStore.instance().store(name=SCHEMA_DEFAULTS, node=drifted)
    try:
        assert load_config(_compose("run", [])) != _outcome(expected_config("model", "tiny", {}))
    finally:
        register_schema_defaults()
    assert load_config(_compose("run", [])) == _outcome(expected_config("model", "tiny", {}))


@pytest.mark.parametrize("path", list(_group_files()), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_group_file_repeats_a_schema_default(path):
    """A group file says only where its option differs from the schema; a repeated default would drift from it
    unseen the day the schema changes. (Experiments may: they override other groups' values.)"""
    defaults = Mrv2Config().model_dump(mode="json")[path.parent.name]
    repeated = repeated_defaults(_keys(path), defaults)
    assert not repeated, f"conf/{path.parent.name}/{path.name} repeats schema defaults: {repeated}"


def test_base_yaml_repeats_no_schema_default():
    assert not repeated_defaults(_keys(CONF / "base.yaml"), Mrv2Config().model_dump(mode="json"))


def test_the_repeat_check_can_fail():
    """Negative control: a planted repeat (nested and flat) is named."""
    defaults = Mrv2Config().model_dump(mode="json")["speculator"]
    planted = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "dynamic": {"explore_every": 32}}
    assert repeated_defaults(planted, defaults) == ["prompt_lookup_min", "dynamic.explore_every"]


@pytest.mark.parametrize("path", list(_group_files()), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_group_file_marks_a_key_mandatory(path):
    """`???` merged onto the schema's default keeps the default (omegaconf#462), so it would only look mandatory;
    pydantic names a missing value instead."""
    assert "???" not in yaml.safe_dump(_keys(path)), f"conf/{path.parent.name}/{path.name}"
