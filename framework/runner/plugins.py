"""The engine's one door to its plugin packages, `model_states` and `speculators`.

No other module of `framework` imports them (tests/test_import_layers.py checks it). The runners build their
model state and speculator here, by name, from the registries of `framework.config.registry`, so a class a third-party
package registers (entry point or decorator) is found exactly like a built-in one and checked against the
interface it must implement. Beside the two interfaces, the door passes on the speculative-decoding machinery
that every method shares and the engine drives: the rejection sampler that verifies drafts, the draft-length
policies the scheduler asks for k, and the acceptance metrics.

Importing this module imports the interfaces, not the built-in implementations: those load on first lookup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from framework.config.registry import SPECULATORS, RegistryError
from model_states.interface import ModelState
from model_states.selection import detect_model_state_name, select_model_state
from speculators.dynamic import build_draft_policy
from speculators.interface import Proposal, ProposeInputs, Speculator
from speculators.metrics import SpecDecodeMetrics
from speculators.policy import DraftLengthPolicy
from speculators.rejection_sampler import rejection_sample

if TYPE_CHECKING:
    from framework.config.schema import SpeculatorConfig
    from framework.models.loaded import LoadedModel

__all__ = [
    "DraftLengthPolicy",
    "ModelState",
    "Proposal",
    "ProposeInputs",
    "SpecDecodeMetrics",
    "Speculator",
    "build_draft_policy",
    "build_model_state",
    "build_speculator",
    "model_state_class",
    "rejection_sample",
]


def model_state_class(
    model_cls: type[nn.Module], hf_config: dict[str, Any], override: Optional[str]
) -> type[ModelState]:
    """The ModelState class a model of `model_cls` gets, without building the model (runner selection)."""
    # detect_model_state_name reads only type(model): an instance without __init__ avoids building the model.
    name = override or detect_model_state_name(object.__new__(model_cls), hf_config)
    return select_model_state(None, hf_config, name)  # type: ignore[arg-type]


def build_model_state(
    model: nn.Module, hf_config: dict[str, Any], override: Optional[str], max_num_reqs: int, device: torch.device
) -> ModelState:
    """The model's ModelState (`model.model_state` override, else the model's own choice, else its config's
    shape: `select_model_state`), built for `max_num_reqs` slots."""
    return select_model_state(model, hf_config, override)(model, hf_config, max_num_reqs, device)


def build_speculator(
    config: "SpeculatorConfig", loaded: "LoadedModel", max_num_reqs: int, device: torch.device
) -> Optional[Speculator]:
    """The speculator `config.method` names in `SPECULATORS`, or None for `method: none`."""
    if config.method == "none":
        return None
    cls = SPECULATORS.get(config.method)
    if not (isinstance(cls, type) and issubclass(cls, Speculator)):
        raise RegistryError(f"speculator '{config.method}' is {cls!r}, not a Speculator subclass")
    return cls(config, loaded, max_num_reqs, device)
