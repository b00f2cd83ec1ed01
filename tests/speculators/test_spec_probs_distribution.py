"""Speculative decoding with draft probabilities keeps the target distribution, end to end in the engine.

A test speculator draws each draft from a fixed q that differs from the target p (and puts mass outside p's
support) and hands q to the runner, so verification takes the probability path (accept with min(1, p/q), else
resample from (p - q)+). Over 1,200 seeded requests of two tokens each (top-k 4, temperature 1), the pair
(first token, verified second token) must follow the exact target distribution, computed from HF transformers'
logits on the same checkpoint: chi-square against p, and no second token outside p's support. The planted fault
"accept every draft" (`test_negative_controls.py`) fails it.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from helpers.hf_models import SPEC_BY_NAME, VOCAB_SIZE, hf_logits, save_tiny_checkpoint

from framework.config.registry import SPECULATORS
from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams
from speculators import Proposal, ProposeInputs, Speculator

PROMPT = [17, 201, 44, 9, 130, 77, 250, 3, 61]
TOP_K = 4
NUM_REQUESTS = 1200
CHI2_999 = {
    df: v
    for df, v in [
        (3, 16.27),
        (4, 18.47),
        (5, 20.52),
        (6, 22.46),
        (7, 24.32),
        (8, 26.12),
        (9, 27.88),
        (10, 29.59),
        (11, 31.26),
        (12, 32.91),
        (13, 34.53),
        (14, 36.12),
        (15, 37.70),
    ]
}


class DrawnFromQ(Speculator):
    """Test-only: one draft per row drawn from a fixed q (half on `favoured`, half uniform over the vocabulary),
    from its own generator, so the draft is independent of the verification's randomness."""

    name = "drawn-from-q-test"
    favoured: list[int] = []  # set by the fixture

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        q = torch.full((VOCAB_SIZE,), 0.5 / VOCAB_SIZE)
        q[self.favoured] += 0.5 / len(self.favoured)
        self.q = q
        self.generator = torch.Generator().manual_seed(0)

    def propose(self, inputs: ProposeInputs) -> Proposal:
        rows, k = inputs.batch.idx_mapping.shape[0], inputs.num_draft_tokens
        ids = torch.multinomial(self.q.expand(rows * k, -1), 1, generator=self.generator).view(rows, k).int()
        return Proposal(ids, self.q.expand(rows, k, -1).contiguous())


def _top_k_probs(logits: torch.Tensor) -> torch.Tensor:
    """[V] float64 softmax of the top-k logits (temperature 1), zero elsewhere: what the sampler draws from."""
    keep = logits.double().topk(TOP_K).indices
    p = torch.zeros_like(logits, dtype=torch.float64)
    p[keep] = torch.softmax(logits.double()[keep], -1)
    return p


def build_target(path: Path) -> tuple[Path, dict[tuple[int, int], float]]:
    """(checkpoint written at `path`, exact P(first, second)) from HF transformers' logits on its weights."""
    hf = save_tiny_checkpoint(SPEC_BY_NAME["llama"], path).eval()
    p0 = _top_k_probs(hf_logits(hf, PROMPT)[-1])
    joint = {}
    for first in p0.nonzero().flatten().tolist():
        p1 = _top_k_probs(hf_logits(hf, PROMPT + [first])[-1])
        for second in p1.nonzero().flatten().tolist():
            joint[(first, second)] = float(p0[first] * p1[second])
    return path, joint


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, dict[tuple[int, int], float]]:
    return build_target(tmp_path_factory.mktemp("spec-q") / "llama")


@contextmanager
def drawn_from_q_registered(joint: dict[tuple[int, int], float]) -> Iterator[None]:
    """`DrawnFromQ` registered, favouring half of the target's possible second tokens (q != p there)."""
    DrawnFromQ.favoured = sorted({s for (_, s) in joint})[::2]
    SPECULATORS.register(DrawnFromQ.name, DrawnFromQ, source="test")
    try:
        yield
    finally:
        SPECULATORS.unregister(DrawnFromQ.name)


@pytest.fixture
def drawn_from_q(target):
    with drawn_from_q_registered(target[1]):
        yield


def sample_pairs(path: Path, speculative: bool, num_requests: int = NUM_REQUESTS) -> tuple[list[tuple[int, int]], dict]:
    spec = {"speculative_config": {"method": DrawnFromQ.name, "num_speculative_tokens": 1}} if speculative else {}
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=32, seed=0, max_num_seqs=256, **spec)
    params = [
        SamplingParams(temperature=1.0, top_k=TOP_K, seed=s, max_tokens=2, ignore_eos=True) for s in range(num_requests)
    ]
    outs = llm.generate([PROMPT] * num_requests, params, use_tqdm=False)
    return [tuple(o.token_ids) for o in outs], llm.get_metrics()


def chi2_against(pairs: list[tuple[int, int]], joint: dict[tuple[int, int], float]) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the pair counts against `joint`, cells expected < 5 pooled."""
    n = len(pairs)
    counts = {cell: 0 for cell in joint}
    for pair in pairs:
        counts[pair] = counts.get(pair, 0) + 1
    big = [c for c in joint if joint[c] * n >= 5]
    observed = [counts[c] for c in big] + [n - sum(counts[c] for c in big)]
    expected = [joint[c] * n for c in big] + [n - sum(joint[c] * n for c in big)]
    if expected[-1] < 5:  # nothing much left to pool: fold the remainder into the last big cell
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    obs, exp = np.array(observed, dtype=np.float64), np.array(expected)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def check_spec_probs_keep_the_target_distribution(
    path: Path, joint: dict[tuple[int, int], float], num_requests: int = NUM_REQUESTS
) -> None:
    pairs, metrics = sample_pairs(path, speculative=True, num_requests=num_requests)
    outside = [pair for pair in pairs if pair not in joint]
    assert not outside, f"{len(outside)} pairs the target never produces (top-k {TOP_K}), e.g. {outside[:3]}"
    stat, df = chi2_against(pairs, joint)
    assert stat < CHI2_999[df], f"chi2 {stat:.1f} with {df} degrees of freedom against the target distribution"
    spec = metrics["spec_decode"]
    # Both verification outcomes occurred: some drafts accepted by u < p/q, some replaced from (p - q)+.
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]


def test_draft_probabilities_keep_the_target_distribution(target, drawn_from_q):
    check_spec_probs_keep_the_target_distribution(*target)


def test_without_speculation_the_same_check_passes(target):
    """The check itself, on the plain sampler: the exact distribution is the engine's, not an artefact."""
    pairs, _ = sample_pairs(target[0], speculative=False)
    assert all(pair in target[1] for pair in pairs)
    stat, df = chi2_against(pairs, target[1])
    assert stat < CHI2_999[df]
