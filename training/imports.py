"""Import mrv2's draft-head modules on a machine that has only torch, transformers and tokenizers.

`framework/__init__.py` imports the config schema (pydantic) and the public API; the draft heads need only
`framework.layers.attention` and `framework.models`, which do not. Where pydantic is missing, `framework` is
registered as a bare package (its directory, without running its `__init__`), so those submodules import.
Where pydantic is present, or `framework` is already imported, nothing changes.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _bare_framework_package() -> None:
    if "framework" in sys.modules or importlib.util.find_spec("pydantic") is not None:
        return
    package = types.ModuleType("framework")
    package.__path__ = [str(REPO / "framework")]  # type: ignore[attr-defined]
    package.__file__ = str(REPO / "framework" / "__init__.py")
    sys.modules["framework"] = package


def draft_head_api() -> dict[str, Any]:
    """{'eagle': EagleHead, 'mtp': MTPHead, 'head_config': head_config, 'load_draft_head': load_draft_head}."""
    _bare_framework_package()
    from speculators.draft_heads import EagleHead, MTPHead, head_config, load_draft_head

    return {"eagle": EagleHead, "mtp": MTPHead, "head_config": head_config, "load_draft_head": load_draft_head}
