"""The project's own model code (HF checkpoints load into it), the `Model` interface and embedded presets.

The package's names load on first use: a plugin that imports `framework.models.interface` for the `Model`
interface does not load the loader, the presets or the model families with it.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "CheckpointError": "framework.models.loader",
    "DecoderConfig": "framework.models.hf_config",
    "PRESETS": "framework.models.presets",
    "UnsupportedModelError": "framework.models.hf_config",
}

__all__ = ["CheckpointError", "DecoderConfig", "PRESETS", "UnsupportedModelError"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'framework.models' has no attribute {name!r}")
