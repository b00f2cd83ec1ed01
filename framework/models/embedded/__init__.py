"""Models shipped inside the package as HF-format directories, loaded exactly like a `model.path`.

`model.preset=tiny` names the trained tiny code model in `tiny-code/` (config.json, model.safetensors,
tokenizer.json, ...), written by `training/train_tiny.py`. Until those files are in the package, `tiny`
falls back to the random-weight geometry `random_tiny` (see `FALLBACK_PRESETS`), so `mrv2 run` keeps
working. The draft heads trained for it (`tiny-code-eagle/`, `tiny-code-mtp/`) ship beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

EMBEDDED_ROOT = Path(__file__).resolve().parent

# preset name -> directory under EMBEDDED_ROOT holding an HF checkpoint (config.json + model.safetensors)
SHIPPED_MODELS: dict[str, str] = {"tiny": "tiny-code"}

# preset name -> random-weight preset used while the shipped directory is absent (before training)
FALLBACK_PRESETS: dict[str, str] = {"tiny": "random_tiny"}

# draft-head kind -> directory under EMBEDDED_ROOT, for the shipped `tiny` model
SHIPPED_DRAFT_HEADS: dict[str, str] = {"eagle": "tiny-code-eagle", "mtp": "tiny-code-mtp"}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from: an HF directory (`path`) or a random-weight preset, never both."""

    path: Optional[str]
    preset: Optional[str]


def _complete_checkpoint(root: Path) -> bool:
    return (root / "config.json").is_file() and any(root.glob("*.safetensors"))


def shipped_model_dir(name: str) -> Optional[Path]:
    """The package directory of shipped model `name`, or None when it is not (yet) in the package."""
    sub = SHIPPED_MODELS.get(name)
    if sub is None:
        return None
    root = EMBEDDED_ROOT / sub
    return root if _complete_checkpoint(root) else None


def shipped_draft_head_dir(kind: str) -> Optional[Path]:
    """The package directory of the shipped tiny model's `kind` ("eagle" or "mtp") draft head, if present."""
    sub = SHIPPED_DRAFT_HEADS.get(kind)
    if sub is None:
        return None
    root = EMBEDDED_ROOT / sub
    return root if _complete_checkpoint(root) else None


def resolve_model_source(path: Optional[str], preset: Optional[str]) -> ModelSource:
    """`model.path` wins; a preset with a shipped directory loads from it; else the preset's random weights."""
    if path is not None:
        return ModelSource(path=path, preset=None)
    if preset is not None:
        shipped = shipped_model_dir(preset)
        if shipped is not None:
            return ModelSource(path=str(shipped), preset=None)
        preset = FALLBACK_PRESETS.get(preset, preset)
    return ModelSource(path=None, preset=preset)
