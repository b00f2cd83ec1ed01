"""The sampler draws from the exact distribution: chi-square over 120,000 seeded draws per configuration.

Each configuration's slot gets 120,000 logits rows in one call (one request verifying many positions, as far
as the sampler can tell): the noise of row i is keyed by (seed, position i), so draws are independent and the
test is deterministic. Expected probabilities are computed here in float64, from the documented semantics.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.sampler_cases import Slot, make_sampler

from framework import SamplingParams
from samplers.sampler import Sampler

N = 120_000
LOGITS = torch.tensor([2.1, 1.7, 1.2, 0.9, 0.4, 0.1, -0.3, -0.8, -1.4, -2.0, -2.9, -3.5])
# chi2.ppf(0.999, df) for df = 1..11: a correct sampler fails one configuration with probability 1e-3.
CHI2_999 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588, 31.264]

CONFIGS = {
    "temperature": dict(temperature=1.0),
    "low-temperature": dict(temperature=0.45),
    "top-k": dict(temperature=1.0, top_k=4),
    "top-p": dict(temperature=1.0, top_p=0.72),
    "min-p": dict(temperature=1.0, min_p=0.15),
    "temp+top-k+top-p": dict(temperature=1.7, top_k=6, top_p=0.8),
    "temp+top-p+min-p": dict(temperature=0.8, top_p=0.9, min_p=0.05),
    "all": dict(temperature=1.3, top_k=7, top_p=0.85, min_p=0.1),
}


def exact_distribution(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """float64 probabilities after temperature, top-k, top-p (on the top-k distribution), then min-p."""
    x = logits.double().numpy() / temperature
    order = np.argsort(-x)
    keep = np.zeros(len(x), dtype=bool)
    keep[order[: top_k if top_k > 0 else len(x)]] = True
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    mass_before = np.cumsum(p[order]) - p[order]
    keep[order[mass_before >= top_p]] = False
    p = np.where(keep, p, 0.0)
    keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def draw_counts(device: str = "cpu", fused=None) -> dict[str, np.ndarray]:
    """Token counts per configuration: every configuration in one sampler call, one slot each.

    `fused` is the sampler's choice of path (None: the fused Triton path on CUDA, the reference on the CPU).
    """
    names = list(CONFIGS)
    slots = [Slot(SamplingParams(**CONFIGS[n]), prompt=[0], seed=1000 + i) for i, n in enumerate(names)]
    sampler, history = make_sampler(slots, len(LOGITS), device=device)
    sampler.fused = fused
    idx = torch.arange(len(names), dtype=torch.int32, device=device).repeat_interleave(N)
    positions = torch.arange(N, device=device).repeat(len(names)) + 1
    req_slots = np.arange(len(names))
    logits = LOGITS.to(device).expand(len(idx), -1).clone()
    out = sampler(logits, idx, positions, sampler.states.stages_for(req_slots))
    tokens = out.sampled_token_ids.view(len(names), N).cpu()
    return {n: torch.bincount(tokens[i], minlength=len(LOGITS)).numpy() for i, n in enumerate(names)}


def assert_chi_square(name: str, counts: np.ndarray) -> None:
    """The counts of configuration `name` pass a chi-square test at level 1e-3 against the exact distribution."""
    expected = exact_distribution(LOGITS, **CONFIGS[name]) * N
    assert counts.sum() == N
    assert (counts[expected == 0] == 0).all(), "a filtered token was sampled"
    # Bins expected fewer than 5 times are pooled into one (the chi-square approximation needs it).
    small = (expected > 0) & (expected < 5)
    observed = np.append(counts[expected >= 5], counts[small].sum())
    predicted = np.append(expected[expected >= 5], expected[small].sum())
    keep = predicted > 0
    chi2 = float((((observed - predicted) ** 2)[keep] / predicted[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 1
    assert chi2 < CHI2_999[df - 1], (name, chi2, counts.tolist(), expected.round(1).tolist())


@pytest.fixture(scope="module")
def draws() -> dict[str, np.ndarray]:
    return draw_counts()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chi_square_against_the_exact_distribution(draws, name):
    assert_chi_square(name, draws[name])


def test_seeded_rows_do_not_depend_on_batch_row_size_or_neighbours():
    """A request's token at a position is a function of (seed, position, its logits) only."""
    vocab = 50
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab, generator=g)
    others = torch.randn(17, vocab, generator=g)
    results = set()
    for batch_size, row in ((1, 0), (4, 3), (17, 9)):
        slots = [Slot(SamplingParams(temperature=1.0, seed=s), prompt=[1], seed=s) for s in range(batch_size)]
        slots[row] = Slot(params, prompt=[1], seed=7)
        sampler, _ = make_sampler(slots, vocab)
        batch_logits = others[:batch_size].clone()
        batch_logits[row] = logits[0]
        idx = torch.randperm(batch_size, generator=g).int()  # any slot order in the batch
        where = int((idx == row).nonzero())
        batch_logits = batch_logits[idx.long()]
        positions = torch.full((batch_size,), 42)
        out = sampler(batch_logits, idx, positions, sampler.states.stages_for(np.arange(batch_size)))
        results.add(int(out.sampled_token_ids[where]))
    assert len(results) == 1


def test_greedy_rows_ignore_sampling_filters_and_nonfinite_rows_are_flagged():
    vocab = 30
    slots = [
        Slot(SamplingParams(temperature=0.0, top_k=1, min_p=0.9), prompt=[1]),
        Slot(SamplingParams(temperature=1.0, top_k=3, seed=1), prompt=[1], seed=1),
        Slot(SamplingParams(temperature=0.0, allowed_token_ids=[4]), prompt=[1]),
        Slot(SamplingParams(temperature=1.0, bad_words=[[5]]), prompt=[1]),
    ]
    sampler: Sampler
    sampler, _ = make_sampler(slots, vocab)
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    logits[1, 7] = float("nan")  # NaN in a random row
    logits[2, :] = float("nan")  # a greedy row that is all NaN
    logits[3, 4] = float("-inf")  # the only allowed token is excluded: nothing left
    logits[4, :] = float("-inf")
    logits[4, 5] = 0.0  # the only finite token is a bad word
    logits[5, :] = float("inf")
    idx = torch.tensor([0, 1, 0, 2, 3, 1], dtype=torch.int32)
    out = sampler(logits.clone(), idx, torch.arange(6) + 10, sampler.states.stages_for(np.arange(4)))
    tokens = out.sampled_token_ids
    assert ((tokens >= 0) & (tokens < vocab)).all()
    assert int(tokens[0]) == int(logits[0].argmax())
    assert out.errors.tolist() == [0, 1, 1, 2, 2, 1]


def test_tiny_temperature_is_greedy_and_never_overflows():
    slots = [Slot(SamplingParams(temperature=1e-9, top_p=0.5, seed=1), prompt=[1], seed=1)]
    sampler, _ = make_sampler(slots, 20)
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(5)) * 50
    out = sampler(
        logits.clone(), torch.zeros(4, dtype=torch.int32), torch.arange(4), sampler.states.stages_for(np.arange(1))
    )
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1)) and out.errors.tolist() == [0] * 4
