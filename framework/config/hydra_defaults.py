"""The schema's defaults as the first config every primary composes, so that group files hold only differences.

`register_schema_defaults()` stores the defaults of `Mrv2Config` in Hydra's ConfigStore as the config
`schema_defaults`. `conf/base.yaml` lists it first in its defaults list: every key of the schema is then in the
composed tree, so `section.key=value` overrides it without a `+`, and a group option's YAML file (merged after it)
says only where that option differs from the schema. Call it before Hydra composes: the CLI, the tests and the
docs build do.

One OmegaConf rule shapes the group files: merging `???` onto a value keeps the value (omegaconf#462), so a group
file cannot make a key that has a schema default mandatory. Pydantic names the missing value instead (`model=hf`
without `model.path`, `speculator=eagle` without `speculator.model`).
"""

from __future__ import annotations

from typing import Any

from framework.config.schema import Mrv2Config

SCHEMA_DEFAULTS = "schema_defaults"  # the name `conf/base.yaml` lists first


def schema_defaults() -> dict[str, Any]:
    """Every key of `Mrv2Config` with its default, as YAML would spell it (tuples become lists)."""
    return Mrv2Config().model_dump(mode="json")


def register_schema_defaults() -> None:
    """Store `schema_defaults()` in Hydra's ConfigStore under `SCHEMA_DEFAULTS`; calling it again is harmless."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_DEFAULTS, node=schema_defaults())
