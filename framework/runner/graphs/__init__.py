"""framework.runner.graphs."""
