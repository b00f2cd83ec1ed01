"""Speculative decoding: the Speculator interface (methods register in `framework.config.registry.SPECULATORS`)."""

from speculators.interface import Proposal, ProposeInputs, Speculator

__all__ = ["Proposal", "ProposeInputs", "Speculator"]
