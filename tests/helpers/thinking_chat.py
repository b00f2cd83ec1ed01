"""The chat that thinks before it answers, shared by the grammar-after-thinking tests (offline and served): a
schema and a tool over it, a chat template that opens the thinking section itself (the prompt ends in
`<think>\\n`), and the question."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{ '# ' + m['role'] + ':\\n# ' + m['content'] + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '# assistant:\\n<think>\\n' }}{%- endif %}"
)
ASK = [{"role": "user", "content": "weather in Paris for 3 days?"}]


def tiny_llm_on_one_thread() -> Iterator[Any]:
    """The embedded tiny model for a module's tests, torch on one thread meanwhile: the tiny model's ops are too
    small to split, and on a busy 2-core machine two threads wait on each other at every op."""
    from framework import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM("tiny", device="cpu")
    finally:
        torch.set_num_threads(threads)
