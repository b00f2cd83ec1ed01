"""Speculative decoding: the Speculator interface (methods register in `framework.registry.SPECULATORS`)."""

from speculators.interface import Proposal, ProposeInputs, Speculator, build_speculator

__all__ = ["Proposal", "ProposeInputs", "Speculator", "build_speculator"]
