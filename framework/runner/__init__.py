"""framework.runner."""
