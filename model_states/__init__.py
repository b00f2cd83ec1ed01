"""Model states: per-architecture state and hooks, selected through the registry."""

from model_states.interface import ModelState
from model_states.selection import detect_model_state_name, select_model_state

__all__ = ["ModelState", "detect_model_state_name", "select_model_state"]
