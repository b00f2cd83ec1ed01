"""Which ModelState a model gets: config override, then the model's own choice, then its config's shape."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from framework.config.registry import MODEL_STATES, RegistryError
from framework.models.interface import Model
from model_states.interface import ModelState


def detect_model_state_name(model: nn.Module, hf_config: dict[str, Any]) -> str:
    """The model class's `model_state_name`, else cross-attention -> encoder_decoder, hybrid -> mamba_hybrid."""
    named = model.model_state_name if isinstance(model, Model) else None
    if named:
        return named
    if hf_config.get("is_encoder_decoder"):
        return "encoder_decoder"
    if any(k in hf_config for k in ("layers_block_type", "hybrid_override_pattern", "attn_layer_period")):
        return "mamba_hybrid"
    return "default"


def select_model_state(model: nn.Module, hf_config: dict[str, Any], override: Optional[str]) -> type[ModelState]:
    """The ModelState class for this model (registry lookup; `RegistryError` lists what is registered, or says
    that the registered object is not a ModelState subclass)."""
    name = override or detect_model_state_name(model, hf_config)
    cls = MODEL_STATES.get(name)
    if not (isinstance(cls, type) and issubclass(cls, ModelState)):
        raise RegistryError(f"model state '{name}' is {cls!r}, not a ModelState subclass")
    return cls
