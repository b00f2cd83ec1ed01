"""HF transformers' greedy tokens of `random_tiny`: the engine tests' reference written outside mrv2.

`HFGreedyReference` holds HF's model class with a copy of `random_tiny`'s weights (the weights of
`LLM("random_tiny", device="cpu")`, seed 0) and caches each prompt's continuation, so a test session builds the
HF model once (`hf_greedy_reference` fixture in tests/conftest.py) and computes each reference once. An
equivalence test (batched == alone, preempted == not) cannot see a bug both of its arms share, such as a
zeroed attention output; a comparison with these tokens can.
"""

from __future__ import annotations

import torch

from helpers.hf_models import hf_greedy


class HFGreedyReference:
    """`reference(prompts, max_tokens)`: HF `generate` greedy tokens per prompt (no eos: exactly max_tokens)."""

    def __init__(self) -> None:
        from framework import LLM
        from framework.entrypoints.bench.hf_reference import hf_model_from_mrv2

        llm = LLM("random_tiny", device="cpu")
        self.model: torch.nn.Module = hf_model_from_mrv2(llm.engine.loaded)
        llm.shutdown()
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        out = []
        for prompt in prompts:
            key = (tuple(prompt), max_tokens)
            if key not in self._cache:
                self._cache[key] = hf_greedy(self.model, list(prompt), max_tokens)
            out.append(self._cache[key])
        return out
