"""Modules the test files share (model builders, fake CUDA graphs, leak and sync checks, the import graph, ...).

`tests/conftest.py` puts `tests/` on `sys.path`, so a test file anywhere under `tests/` imports them as
`from helpers.<module> import ...`.
"""
