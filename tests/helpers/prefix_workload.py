"""The shared-prefix requests of the prefix-caching equality tests (decoder-only and Mamba hybrid)."""

from __future__ import annotations

import random

from framework import SamplingParams
from helpers.hf_models import VOCAB_SIZE


def first_wave(block_size: int) -> list[list[int]]:
    """Prompts sharing a 44-token system prompt in whole, in part (inside the first block, exactly one block),
    twice identically, and one sharing nothing."""
    rng = random.Random(block_size)
    system = [rng.randrange(VOCAB_SIZE) for _ in range(44)]
    cut_short, cut_block = max(block_size // 2, 1), block_size  # inside the first block; exactly one block

    def tail(n: int) -> list[int]:
        return [rng.randrange(VOCAB_SIZE) for _ in range(n)]

    return [
        system + tail(5),
        system[:cut_short] + tail(6),
        system[:cut_block] + tail(3),
        system + tail(9),
        system[:40],
        system[:40],
        tail(12),
        system[:cut_block],
    ]


def mixed_params(n: int, max_tokens: int) -> list[SamplingParams]:
    """Greedy and seeded-sampling requests, alternating."""
    return [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(n)
    ]
