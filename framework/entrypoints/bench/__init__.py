"""framework.entrypoints.bench."""
