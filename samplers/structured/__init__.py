"""Structured outputs in the sampler: the grammar backend, the per-slot matcher state and the bitmask kernel."""
