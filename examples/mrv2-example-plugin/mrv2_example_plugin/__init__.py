"""Example mrv2 plugin: a steering ModelState and the Qwen3 variant that reads its inputs.

Nothing here is imported by mrv2 until a registered name is used: the entry points in pyproject.toml name
the classes as lazy `module:Class` strings.
"""
