"""The project's own model code (HF checkpoints load into it) and embedded presets."""

from framework.models.hf_config import DecoderConfig, UnsupportedModelError
from framework.models.loader import CheckpointError
from framework.models.presets import PRESETS

__all__ = ["CheckpointError", "DecoderConfig", "PRESETS", "UnsupportedModelError"]
