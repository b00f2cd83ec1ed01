"""`mrv2 serve`: an OpenAI-compatible HTTP server in front of an engine-core process (see docs/serving.md)."""
