"""Parallel runs against one process: the same greedy tokens and prompt logprobs within a tolerance."""

from __future__ import annotations

from framework.engine.request import RequestOutput


def assert_same_outputs(
    got: list[RequestOutput], want: list[RequestOutput], prompts: list[list[int]], atol: float
) -> float:
    """Greedy tokens equal and every prompt token's logprob within `atol`; returns the largest difference."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    worst = 0.0
    for g, w, prompt in zip(got, want, prompts):
        assert g.prompt_logprobs is not None and w.prompt_logprobs is not None
        for position, token in enumerate(prompt[1:], start=1):
            a, b = g.prompt_logprobs[position], w.prompt_logprobs[position]
            assert a is not None and b is not None
            worst = max(worst, abs(a[token].logprob - b[token].logprob))
    assert worst <= atol, f"prompt logprobs differ by up to {worst:.2e}"
    return worst
