"""framework.engine.core."""
