"""Multi-turn conversations for the host KV tier tests: each turn's prompt is the conversation so far (its context,
earlier prompts and outputs) plus new user tokens, so every turn re-hits the whole earlier conversation."""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

from framework import SamplingParams
from helpers.hf_models import VOCAB_SIZE


def contexts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(length)] for _ in range(num)]


def params_for(turn: int, num: int, max_tokens: int, n: int = 1) -> list[SamplingParams]:
    """Greedy and seeded-sampling requests, alternating (seeds differ per turn)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
        if i % 2 == 0
        else SamplingParams(
            temperature=0.9, top_k=20, seed=1000 * turn + i, max_tokens=max_tokens, ignore_eos=True, n=n
        )
        for i in range(num)
    ]


def run_turns(
    llm: Any,
    starts: list[list[int]],
    turns: int,
    max_tokens: int,
    n: int = 1,
    between_turns: Optional[Callable[[int], None]] = None,
) -> tuple[list[list[list[int]]], int]:
    """Every conversation's turn `t` in one `generate` call, turn after turn; returns (per turn, every sequence's
    tokens; the preemptions of all requests). n > 1: each conversation goes on with its first sequence.
    `between_turns(t)` runs before turn t."""
    rng = random.Random(1)
    history = [list(c) for c in starts]
    outputs, preemptions = [], 0
    for turn in range(turns):
        if between_turns is not None:
            between_turns(turn)
        prompts = [h + [rng.randrange(VOCAB_SIZE) for _ in range(2)] for h in history]
        results = llm.generate(prompts, params_for(turn, len(prompts), max_tokens, n), use_tqdm=False)
        outputs.append([seq.token_ids for r in results for seq in r.outputs])
        history = [p + r.outputs[0].token_ids for p, r in zip(prompts, results)]
        preemptions += sum(r.num_preemptions for r in results)
    return outputs, preemptions
