"""framework.config.schema."""
