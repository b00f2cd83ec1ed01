"""framework.layers.parallel."""
