"""framework.entrypoints."""
