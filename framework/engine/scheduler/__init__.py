"""framework.engine.core.scheduler."""
