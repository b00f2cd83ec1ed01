"""framework.params."""
