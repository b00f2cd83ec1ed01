"""Speculative decoding: the Speculator interface (methods register in `framework.registry.SPECULATORS`)."""

from speculators.interface import Speculator

__all__ = ["Speculator"]
