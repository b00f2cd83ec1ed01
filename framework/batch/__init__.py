"""framework.batch."""
