"""`n > 1` without a seed: each sequence is an independent draw from the request's distribution."""

from __future__ import annotations

import math

from framework import SamplingParams

TOP_K = 4
CHI2_999_DF3 = 16.266  # chi2.ppf(0.999, 3): a correct engine fails with probability 1e-3


def test_unseeded_children_are_independent_draws(tiny_llm_factory):
    llm = tiny_llm_factory(max_num_seqs=128)
    engine = llm.engine
    prompt = [7, 42, 99, 3, 250]
    params = SamplingParams(n=128, temperature=1.0, top_k=TOP_K, max_tokens=1, logprobs=TOP_K, ignore_eos=True)
    engine.add_request("parent", prompt, params)
    seeds = [request.sampling_seed for request in engine.scheduler.requests.values()]
    assert len(seeds) == 128 and len(set(seeds)) == 128, "unseeded children must get distinct seeds"

    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in outputs) == list(range(128))
    first_tokens = [o.token_ids[0] for o in outputs]

    # The exact top-k distribution at temperature 1: the top-k logprobs of the step, renormalised.
    top = outputs[0].logprobs[0]
    ranked = sorted(((lp.rank, token, lp.logprob) for token, lp in top.items() if lp.rank is not None))[:TOP_K]
    support = {token: math.exp(logprob) for _, token, logprob in ranked}
    total = sum(support.values())
    assert set(first_tokens) <= set(support)
    chi2 = 0.0
    for token, p in support.items():
        expected = len(first_tokens) * p / total
        chi2 += (first_tokens.count(token) - expected) ** 2 / expected
    assert chi2 < CHI2_999_DF3, f"first tokens {first_tokens} do not follow {support} (chi2 {chi2:.1f})"
