"""framework.layers."""
