"""Every key of the pydantic schema can be overridden from the command line under every group option (issue 28):
the schema's defaults, composed first (`framework/config/hydra_defaults.py`), put every key in the tree whatever
the group files say, and a Hydra error is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from pydantic import BaseModel

from framework.config.schema import Mrv2Config
from framework.entrypoints.cli import conf_dir

REPO = Path(__file__).resolve().parents[2]
GROUPS = ("model", "runner", "sampler", "speculator", "scheduler", "cache", "parallel", "serve", "experiment")


def schema_leaves(model: type[BaseModel] = Mrv2Config, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, default) of every leaf of the schema; a sub-model is walked, not a leaf."""
    defaults = model().model_dump(mode="json")
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from schema_leaves(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", defaults[name]


def _override_value(value: Any) -> str:
    return json.dumps(value)  # Hydra's override grammar reads JSON scalars, quoted strings and [lists]


def _has_key(cfg: Any, dotted: str) -> bool:
    """Whether the composed tree has this key (a mandatory `???` value counts: it has the key)."""
    from omegaconf import OmegaConf

    parent_key, _, leaf = dotted.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    return OmegaConf.is_dict(parent) and leaf in list(parent.keys())


def _group_choices() -> Iterator[tuple[str, str, str]]:
    for primary in ("run", "bench", "serve"):
        for group in GROUPS:
            for option in sorted(p.stem for p in (conf_dir() / group).glob("*.yaml")):
                yield primary, group, option


def test_the_schema_walk_sees_nested_keys():
    keys = dict(schema_leaves())
    assert keys["speculator.dynamic.explore_every"] == 32 and "speculator.dynamic" not in keys
    assert {"bench.warmup_requests", "speculator.model", "speculator.draft_cuda_graphs", "device"} <= keys.keys()


@pytest.mark.parametrize("primary, group, option", list(_group_choices()))
def test_every_schema_key_composes_as_an_override(primary, group, option):
    """The rule: every schema key is overridable from the command line, without `+`. All schema keys at once, each
    set to its schema default, compose under this group option (a key missing from the composed tree would be
    Hydra's "Key ... is not in struct")."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    leaves = list(schema_leaves())
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        plain = compose(config_name=primary, overrides=[f"{group}={option}"])
        missing = [key for key, _ in leaves if not _has_key(plain, key)]
        assert not missing, f"{primary} {group}={option}: keys of the schema missing from the composed tree: {missing}"
        cfg = compose(
            config_name=primary, overrides=[f"{group}={option}"] + [f"{k}={_override_value(v)}" for k, v in leaves]
        )
    for key, value in leaves:
        got = OmegaConf.select(cfg, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert got == value, (key, got, value)


@pytest.mark.parametrize("full_error", [None, "0"])  # Hydra reads HYDRA_FULL_ERROR=0 as unset
@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "+model.preset=tiny", "--cfg", "job"], "An item is already at 'model.preset'"),
        (["bench", "experiment=smoke", "~speculator.nope", "--cfg", "job"], "'speculator.nope' does not exist"),
        (["run", "model.preset=${nope}"], "Interpolation key 'nope' not found"),
    ],
)
def test_a_hydra_error_is_one_line_with_exit_2(args, message, full_error):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    if full_error is not None:
        env["HYDRA_FULL_ERROR"] = full_error
    proc = subprocess.run(
        [sys.executable, "-m", "framework.entrypoints.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("mrv2: error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
