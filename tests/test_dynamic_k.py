"""Dynamic-k on synthetic costs and acceptance: k = 0 when drafts are useless, large k when they are good, and
it follows a workload whose acceptance or batch size changes mid-run."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from framework.config import load_config
from speculators.dynamic import AcceptanceTracker, DynamicK, MeasuredCostModel, batch_bucket
from speculators.policy import FixedK, build_draft_policy

MAX_K = 5


class SyntheticCost:
    """t(B, k) = fixed + per_token * B * (1 + k) + draft * k: verification gets dearer with batch size."""

    def __init__(self, fixed: float = 1.0, per_token: float = 0.002, draft: float = 0.05) -> None:
        self.fixed, self.per_token, self.draft = fixed, per_token, draft

    def cost(self, num_rows: int, k: int) -> float:
        return self.fixed + self.per_token * num_rows * (1 + k) + self.draft * k

    def observe(self, num_rows: int, k: int, seconds: float) -> None:
        pass


def _run(policy: DynamicK, steps: int, rows: int, accept_p: float, rng: random.Random) -> list[int]:
    """Drive the policy like the engine: choose k, then report each row's leading accepted drafts."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(rows)
        chosen.append(k)
        if k:
            accepted = []
            for _ in range(rows):
                a = 0
                while a < k and rng.random() < accept_p:
                    a += 1
                accepted.append(a)
            policy.observe_acceptance([k] * rows, accepted)
    return chosen


def _mode(ks: list[int]) -> int:
    return Counter(ks).most_common(1)[0][0]


def test_zero_acceptance_picks_k0():
    policy = DynamicK(MAX_K, SyntheticCost())
    ks = _run(policy, 200, rows=8, accept_p=0.0, rng=random.Random(0))
    assert _mode(ks[50:]) == 0
    assert Counter(ks[50:])[0] >= 0.9 * 150  # only exploration steps draft


def test_high_acceptance_picks_large_k_at_small_batch():
    policy = DynamicK(MAX_K, SyntheticCost())
    ks = _run(policy, 200, rows=4, accept_p=0.95, rng=random.Random(1))
    assert _mode(ks[50:]) == MAX_K


def test_large_batch_prefers_smaller_k_than_small_batch():
    # Verification cost grows with B * (1 + k): at 256 rows the best k is lower than at 1 row.
    small, large = DynamicK(MAX_K, SyntheticCost()), DynamicK(MAX_K, SyntheticCost())
    rng = random.Random(2)
    k_small = _mode(_run(small, 150, rows=1, accept_p=0.7, rng=rng)[50:])
    k_large = _mode(_run(large, 150, rows=256, accept_p=0.7, rng=rng)[50:])
    assert k_small > k_large >= 1


def test_expected_tokens_matches_the_formula():
    # The decision rule, checked against exact E(k) / t(B, k) with known acceptance.
    policy = DynamicK(MAX_K, SyntheticCost(), acceptance_decay=0.999)
    policy.observe_acceptance([MAX_K] * 100_000, [MAX_K] * 90_000 + [0] * 10_000)  # a_0 = 0.9, a_j>0 = 1.0
    e = [policy.acceptance.expected_tokens(k) for k in range(MAX_K + 1)]
    assert e[0] == 1.0 and e[1] == pytest.approx(1.9, abs=1e-3) and e[2] == pytest.approx(2.8, abs=1e-3)
    cost = SyntheticCost()
    want = max(range(MAX_K + 1), key=lambda k: e[k] / cost.cost(32, k))
    assert policy.best_k(32) == want


def test_reacts_when_acceptance_changes_mid_run():
    policy = DynamicK(MAX_K, SyntheticCost(), explore_every=8)
    rng = random.Random(3)
    high = _run(policy, 100, rows=8, accept_p=0.95, rng=rng)
    low = _run(policy, 150, rows=8, accept_p=0.0, rng=rng)
    again = _run(policy, 250, rows=8, accept_p=0.95, rng=rng)
    assert _mode(high[30:]) == MAX_K
    assert _mode(low[60:]) == 0  # drops to 0 once the bad acceptance dominates the averages
    # Exploration steps (k unused for longest) see the good acceptance again and k climbs back.
    assert _mode(again[150:]) == MAX_K


def test_measured_costs_explore_both_ends_then_interpolate():
    cost = MeasuredCostModel()
    policy = DynamicK(4, cost, explore_every=0)
    assert policy.choose(16) == 0  # nothing measured at this batch size: k = 0 first
    policy.observe_step(16, 0, 1.0)
    assert policy.choose(16) == 4  # then the largest k
    policy.observe_step(16, 4, 1.4)
    assert policy.costs(16) == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4])  # the rest interpolated
    policy.observe_step(16, 2, 1.05)  # a measured k replaces its interpolation; neighbours follow it
    assert policy.costs(16) == pytest.approx([1.0, 1.025, 1.05, 1.225, 1.4])
    policy.observe_acceptance([4] * 50, [4] * 45 + [0] * 5)
    assert policy.choose(16) == 4
    assert policy.choose(200) == 0  # another bucket: its costs are unknown
    assert batch_bucket(200) == 256 and batch_bucket(1) == 1 and batch_bucket(10**6) == 4096


def test_acceptance_tracker_reverts_to_the_prior_without_observations():
    tracker = AcceptanceTracker(2, decay=0.5, prior=0.5)
    tracker.observe([2] * 100, [0] * 100)
    assert tracker.rates()[0] < 0.01
    for _ in range(30):
        tracker.tick()
    assert tracker.rates()[0] == pytest.approx(0.5, abs=0.01)


def test_build_policy_from_config():
    spec = load_config({"speculator": {"method": "dynamic", "num_speculative_tokens": 4}}).speculator
    policy = build_draft_policy(spec)
    assert isinstance(policy, DynamicK) and policy.max_k == 4
    fixed = build_draft_policy(load_config({"speculator": {"method": "ngram", "num_speculative_tokens": 3}}).speculator)
    assert isinstance(fixed, FixedK) and fixed.choose(100) == 3
    assert build_draft_policy(load_config({}).speculator) is None
