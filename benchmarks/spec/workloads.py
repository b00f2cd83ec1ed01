"""What `bench_spec.py` runs: the nano engine with or without ngram speculation, and the requests of each workload
(`greedy-repeat`, `sampled`, `shifting`; see the script's docstring)."""

from __future__ import annotations

import random

BATCH_SIZES = (1, 16, 64, 256)
FIXED_KS = (0, 1, 2, 3, 5)
K_MAX = 5


def build_llm(speculate: bool, max_model_len: int, smoke: bool = False):  # type: ignore[no-untyped-def]
    from framework import LLM
    from framework.config.schema import load_config

    spec = (
        {
            "method": "ngram",
            "dynamic_k": True,
            "num_speculative_tokens": K_MAX,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        }
        if speculate
        else {"method": "none"}
    )
    config = load_config(
        {
            "model": {"preset": "tiny" if smoke else "qwen3-0.6b", "max_model_len": max_model_len},
            "device": "cpu" if smoke else "cuda",
            "scheduler": {"max_num_seqs": max(BATCH_SIZES), "max_num_batched_tokens": 8192},
            "runner": {"cuda_graph_sizes": list(BATCH_SIZES)},
            "speculator": spec,
            "seed": 0,
        }
    )
    return LLM(config=config)


def repeat_prompt(rng: random.Random, vocab: int) -> list[int]:
    segment = [rng.randrange(vocab) for _ in range(16)]
    return segment * 8


def workload(name: str, batch: int, output_len: int, vocab: int, seed: int) -> tuple[list, list]:
    """(prompts, SamplingParams per request) of one run."""
    from framework import SamplingParams

    rng = random.Random(seed)
    prompts = [repeat_prompt(rng, vocab) for _ in range(batch)]
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if name == "greedy-repeat":
        return prompts, [greedy] * batch
    if name == "sampled":
        return prompts, [
            SamplingParams(temperature=1.0, seed=seed + i, max_tokens=output_len, ignore_eos=True) for i in range(batch)
        ]
    assert name == "shifting"
    short = [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=output_len // 4, ignore_eos=True)
        for i in range(batch - 4)
    ]
    long = [SamplingParams(temperature=0.0, max_tokens=output_len * 4, ignore_eos=True)] * 4
    return prompts, short + long
