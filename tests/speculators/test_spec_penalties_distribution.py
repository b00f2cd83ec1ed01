"""Probabilistic verification keeps the *penalised* target distribution (chi-square over seeded draws).

Each request has output [0, 0, 2] after prompt [4] and verifies two drafts drawn from q != p. The sampler
penalises its three logits rows (the second counting draft 0 as output, the bonus row both drafts), then the
rejection sampler verifies against those rows, as the runner does. The first output token must follow the
penalised p0; given draft 0 accepted as v, the second must follow p1 penalised with v counted once more, and
given both accepted the bonus p2 with both counted. Expected probabilities are computed here in float64 from
the documented penalty semantics. Draws are keyed by (seed, position): deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.sampler_cases import Slot, make_sampler

from framework import SamplingParams
from speculators.rejection_sampler import rejection_sample

VOCAB = 5
SLOTS, ROUNDS = 4000, 30  # 120,000 requests: SLOTS slots, each reseeded ROUNDS times
CHI2_999_DF4 = 18.467  # chi2.ppf(0.999, 4)
PROMPT, OUTPUT = [4], [0, 0, 2]
PARAMS = dict(temperature=1.0, repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4)
# Raw target logits of the two verification rows and the bonus row.
LOGITS = torch.tensor([[1.2, 0.9, 0.5, 0.2, -0.3], [0.3, 1.1, 0.8, -0.2, 0.6], [0.9, 0.1, 1.0, 0.4, 0.2]])
Q = torch.tensor([[0.1, 0.2, 0.2, 0.2, 0.3], [0.3, 0.1, 0.3, 0.1, 0.2]])  # draft distributions, positions 0 and 1


def penalised(logits: torch.Tensor, extra: list[int]) -> np.ndarray:
    """float64 softmax of `logits` penalised with the output OUTPUT + extra (vLLM semantics)."""
    x = logits.double().numpy().copy()
    counts = np.bincount(OUTPUT + extra, minlength=VOCAB).astype(np.float64)
    seen = (counts > 0) | np.isin(np.arange(VOCAB), PROMPT)
    rep = PARAMS["repetition_penalty"]
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x -= PARAMS["frequency_penalty"] * counts + PARAMS["presence_penalty"] * (counts > 0)
    p = np.exp(x - x.max())
    return p / p.sum()


def chi2(observed: np.ndarray, p: np.ndarray) -> float:
    expected = p * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.fixture(scope="module")
def draws() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(tokens [N, 3], accepted [N]) per verification mode, over every round (one torch thread: these small
    ops are far faster that way on a shared CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _draws()
    finally:
        torch.set_num_threads(threads)


def _draws() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    params = SamplingParams(**PARAMS)
    sampler, history = make_sampler(
        [Slot(params, PROMPT, OUTPUT, seed=i) for i in range(SLOTS)], VOCAB, max_len=8, num_draft=2
    )
    states = sampler.states
    slots = torch.arange(SLOTS, dtype=torch.int32)
    expanded = slots.repeat_interleave(3)
    cu = torch.arange(SLOTS + 1, dtype=torch.int32) * 3
    positions = history.total_len.long()[expanded.long()] + torch.arange(3).repeat(SLOTS)  # 4, 5, 6
    logits = LOGITS.repeat(SLOTS, 1)
    stages = states.stages_for(np.arange(SLOTS))
    assert stages.any_penalties and stages.any_random
    g = torch.Generator().manual_seed(5)
    out: dict[str, list] = {"with_q": [], "one_hot": []}
    for _ in range(ROUNDS):
        history.draft_tokens.copy_(
            torch.stack([torch.multinomial(q, SLOTS, replacement=True, generator=g) for q in Q], 1)
        )
        sampled = sampler(logits.clone(), expanded, positions, stages, keep_processed=True)
        seeds = states.params.gather(expanded).seed
        draft_probs = Q.unsqueeze(0).expand(SLOTS, 2, VOCAB)
        with_q = rejection_sample(
            sampled.sampled_token_ids,
            slots,
            cu,
            history.draft_tokens,
            2,
            processed_logits=sampled.processed_logits,
            draft_probs=draft_probs,
            expanded_idx_mapping=expanded,
            use_q=torch.ones(3 * SLOTS, dtype=torch.bool),
            seeds=seeds,
            positions=positions,
        )
        one_hot = rejection_sample(sampled.sampled_token_ids, slots, cu, history.draft_tokens, 2)
        for name, result in (("with_q", with_q), ("one_hot", one_hot)):
            out[name].append((result.tokens.numpy(), result.num_accepted.numpy()))
        states.params.tensors["seed"] += SLOTS  # fresh, distinct seeds next round
    return {
        name: (np.concatenate([t for t, _ in rounds]), np.concatenate([a for _, a in rounds]))
        for name, rounds in out.items()
    }


@pytest.mark.parametrize("mode", ["with_q", "one_hot"])
def test_verification_keeps_the_penalised_target_distribution(draws, mode):
    tokens, accepted = draws[mode]
    first = np.bincount(tokens[:, 0], minlength=VOCAB)
    assert chi2(first, penalised(LOGITS[0], [])) < CHI2_999_DF4
    wrong = 0.0  # the same test against penalties that ignore the drafts: it must be able to fail
    for v in range(VOCAB):
        rows = (accepted >= 1) & (tokens[:, 0] == v)
        second = np.bincount(tokens[rows, 1], minlength=VOCAB)
        assert second.sum() > 300, v
        assert chi2(second, penalised(LOGITS[1], [v])) < CHI2_999_DF4, v
        wrong = max(wrong, chi2(second, penalised(LOGITS[1], [])))
    assert wrong > 10 * CHI2_999_DF4
    # The bonus token, given both drafts accepted: expected counts summed over each row's own drafts.
    both = accepted == 2
    bonus = np.bincount(tokens[both, 2], minlength=VOCAB)
    pairs, times = np.unique(tokens[both, :2], axis=0, return_counts=True)
    expected = sum(n * penalised(LOGITS[2], [int(a), int(b)]) for (a, b), n in zip(pairs, times))
    assert chi2(bonus, expected / expected.sum()) < CHI2_999_DF4
