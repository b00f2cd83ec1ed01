"""Dynamic-k on synthetic costs and acceptance: k = 0 when drafts are useless, large k when they are good, and
it follows a workload whose acceptance or batch size changes mid-run (also when the requests that change are
a few of many)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from framework.config.schema import load_config
from speculators.acceptance import AcceptanceTracker, RequestAcceptance
from speculators.dynamic import EXPLORE_STEPS, DynamicK, build_draft_policy
from speculators.policy import FixedK

MAX_K = 5


class SyntheticCost:
    """t(B, k) = fixed + per_token * B * (1 + k) + draft * k: verification gets dearer with batch size."""

    def __init__(self, fixed: float = 1.0, per_token: float = 0.002, draft: float = 0.05) -> None:
        self.fixed, self.per_token, self.draft = fixed, per_token, draft

    def cost(self, num_rows: int, k: int) -> float:
        return self.fixed + self.per_token * num_rows * (1 + k) + self.draft * k

    def observe(self, num_rows: int, k: int, seconds: float) -> None:
        pass


def _ids(rows: int, prefix: str = "r") -> list[str]:
    return [f"{prefix}{i}" for i in range(rows)]


def _run(
    policy: DynamicK,
    steps: int,
    rows: int,
    accept_p: float,
    rng: random.Random,
    ids: list[str] | None = None,
    accept_of: dict[str, float] | None = None,
) -> list[int]:
    """Drive the policy like the engine: choose k, then report each row's leading accepted drafts
    (row r accepts each draft with `accept_of[r]` if given, else `accept_p`)."""
    ids = ids if ids is not None else _ids(rows)
    chosen = []
    for _ in range(steps):
        k = policy.choose(ids)
        chosen.append(k)
        if k:
            accepted = []
            for r in ids:
                p = accept_of[r] if accept_of is not None else accept_p
                a = 0
                while a < k and rng.random() < p:
                    a += 1
                accepted.append(a)
            policy.observe_acceptance(ids, [k] * len(ids), accepted)
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
    ids = _ids(100_000)
    policy.observe_acceptance(ids, [MAX_K] * 100_000, [MAX_K] * 90_000 + [0] * 10_000)  # a_0 = 0.9, a_j>0 = 1
    policy.fold_observations()  # a step only queues; a decision folds
    e = [policy.acceptance.expected_tokens(k) for k in range(MAX_K + 1)]
    assert e[0] == 1.0 and e[1] == pytest.approx(1.9, abs=1e-3) and e[2] == pytest.approx(2.8, abs=1e-3)
    cost = SyntheticCost()
    want = max(range(MAX_K + 1), key=lambda k: e[k] / cost.cost(32, k))
    fresh = [f"n{i}" for i in range(32)]  # unseen requests: the batch-wide rates
    assert policy.best_k(fresh) == want
    assert policy.expected_tokens(fresh) == pytest.approx(e)


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


def test_exploration_alternates_max_k_and_the_least_recent_k_and_spaces_dear_ones():
    policy = DynamicK(MAX_K, SyntheticCost(), explore_every=4, record=True)
    ks = _run(policy, 600, rows=8, accept_p=0.0, rng=random.Random(7))
    # Acceptance ~0: once the prior (0.5) has given way to observations, the best k is 0 and the rest explores,
    # each exploration holding its k for EXPLORE_STEPS steps.
    assert policy.decisions is not None
    runs = [
        d
        for i, d in enumerate(policy.decisions)
        if d.reason == "explore" and d.step >= 10 and policy.decisions[i - 1].reason != "explore"
    ]  # the first step of each exploration
    for d in runs:
        assert ks[d.step - 1 : d.step - 1 + EXPLORE_STEPS] == [d.k] * EXPLORE_STEPS
    steps = [d.step for d in runs]
    explored = [d.k for d in runs]
    maxes = explored[0::2] if explored[0] == MAX_K else explored[1::2]
    others = explored[1::2] if explored[0] == MAX_K else explored[0::2]
    assert set(maxes) == {MAX_K} and len(maxes) >= 5  # every other exploration observes every position
    assert set(others[:4]) == {1, 2, 3, 4}  # the others cycle through the k used least recently
    gaps = {k: [b - a for a, b, k2 in zip(steps, steps[1:], explored[1:]) if k2 == k] for k in (1, MAX_K)}
    # An exploration waits after the one before it according to its own cost. A step at k = 5 loses ~25% of a
    # step's tokens/s here (t(8, 5) / t(8, 0) = 1.33): EXPLORE_STEPS * 0.25 / EXPLORE_BUDGET steps; one at
    # k = 1 loses ~6%: about 18 steps.
    assert min(gaps[MAX_K]) >= 60 and max(gaps[1]) <= 24


def test_requests_that_accept_take_over_when_the_others_finish():
    """A large batch of requests that never accept drafts plus a few that always do (the `shifting` workload):
    k = 0 while the batch is large, and a large k within a few steps once the others have finished (the
    policy knows each request's acceptance, so it need not wait for batch-wide averages to decay)."""
    policy = DynamicK(MAX_K, SyntheticCost(per_token=0.01), explore_every=8)
    rng = random.Random(5)
    good, bad = _ids(4, "g"), _ids(252, "b")
    accept_of = {**{r: 0.95 for r in good}, **{r: 0.0 for r in bad}}
    mixed = _run(policy, 64, 0, 0.0, rng, ids=good + bad, accept_of=accept_of)
    assert Counter(mixed[16:])[0] >= 0.8 * 48
    for r in bad:
        policy.remove_request(r)
    policy.fold_observations()
    assert len(policy.requests) == 4
    tail = _run(policy, 20, 0, 0.0, rng, ids=good, accept_of=accept_of)
    assert tail[1:].count(MAX_K) >= 16, tail


def test_request_acceptance_rows_are_reused_clean():
    acc = RequestAcceptance(3, decay=1.0, prior_weight=1.0)
    prior = np.array([0.5, 0.5, 0.5])
    acc.observe(["a", "b"], [3, 3], [3, 0])
    assert acc.expected_tokens(["a"], prior) == pytest.approx(
        [1.0, 1.75, 2.3125, 2.734375]
    )  # rates (1 + 0.5) / (1 + 1)
    acc.remove("a")
    acc.observe(["c"], [3], [0])  # takes a's row: nothing of a's counts remains
    assert acc.expected_tokens(["c"], prior) == pytest.approx(acc.expected_tokens(["b"], prior))
    for i in range(40):  # growth past the first allocation keeps earlier rows
        acc.observe([f"x{i}"], [1], [1])
    assert len(acc) == 42 and acc.expected_tokens(["b"], prior)[1] == pytest.approx(1.25)


def test_acceptance_estimates_hold_while_nothing_is_drafted():
    """The batch-wide rates decay per step that verified drafts: steps at k = 0 measure nothing and leave the
    estimate where it was (drifting back to the prior of 0.5 would make drafting look worth it again)."""
    tracker = AcceptanceTracker(2, decay=0.5, prior=0.5)
    tracker.observe([2] * 100, [0] * 100)
    assert tracker.rates()[0] < 0.01 and tracker.rates()[1] == 0.5  # position 1 was never attempted
    policy = DynamicK(MAX_K, SyntheticCost(), explore_every=0, record=True)
    ids = _ids(8)
    _run(policy, 40, rows=8, accept_p=0.0, rng=random.Random(1))
    assert policy.history[-20:] == [0] * 20
    before = policy.acceptance.rates().copy()
    _run(policy, 200, rows=8, accept_p=0.0, rng=random.Random(1))  # at k = 0: nothing observed
    assert policy.acceptance.rates() == pytest.approx(before) and set(policy.history[-200:]) == {0}
    policy.observe_acceptance(ids, [MAX_K] * 8, [MAX_K] * 8)  # one step of new observations moves it
    policy.fold_observations()
    assert policy.acceptance.rates()[0] > before[0] + 0.1


def test_build_policy_from_config():
    spec = load_config({"speculator": {"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": True}}).speculator
    policy = build_draft_policy(spec)
    assert isinstance(policy, DynamicK) and policy.max_k == 4
    fixed = build_draft_policy(load_config({"speculator": {"method": "ngram", "num_speculative_tokens": 3}}).speculator)
    assert isinstance(fixed, FixedK) and fixed.choose(_ids(100)) == 3
    assert build_draft_policy(load_config({}).speculator) is None


def test_record_logs_every_step_with_its_reason():
    policy = DynamicK(MAX_K, SyntheticCost(), record=True, explore_every=8)
    ks = _run(policy, 200, rows=4, accept_p=0.5, rng=random.Random(7))
    log = policy.decisions
    assert log is not None and [d.k for d in log] == ks == policy.history
    assert {d.reason for d in log} <= {"decide", "keep", "explore", "measure"} and "explore" in {d.reason for d in log}
    decided = [d for d in log if d.reason == "decide"]
    assert decided and all(len(d.rates) == len(d.costs_ms) == MAX_K + 1 and len(d.acceptance) == MAX_K for d in decided)
    assert DynamicK(MAX_K, SyntheticCost()).decisions is None  # off by default: no cost on the step path


def test_the_k_in_use_is_kept_unless_another_is_clearly_better():
    """best_k keeps `current` when the argmax beats it by less than MARGIN (no flapping on noise), and
    switches when the gain is larger."""
    from speculators.dynamic import MARGIN

    class Table:
        def __init__(self, costs):
            self.costs = costs

        def cost(self, num_rows, k):
            return self.costs[k]

        def observe(self, *a):
            pass

    policy = DynamicK(2, Table([1.0, 1.0, 1.0]), prior_acceptance=0.0)  # E(k) = 1 for every k: all equal
    assert policy.best_k(["a"]) == 0  # smallest k on a tie
    assert policy.best_k(["a"], current=2) == 0  # no drafting by inertia when nothing is gained
    policy = DynamicK(2, Table([0.9, 1.0, 1.0 + 0.5 * MARGIN]), prior_acceptance=1.0)  # E(k) = 1 + k
    assert policy.best_k(["a"]) == 2  # rates 1.1, 2, 2.97: k = 2 is MARGIN better than k = 1
    policy.cost_model = Table([0.9, 1.0, 1.5 * (1 + 0.5 * MARGIN)])  # k = 1 beats k = 2 by < MARGIN
    assert policy.best_k(["a"], current=2) == 2 and policy.best_k(["a"]) == 1
    policy.cost_model = Table([0.9, 1.0, 1.5 * (1 + 3 * MARGIN)])  # k = 1 beats k = 2 by > MARGIN
    assert policy.best_k(["a"], current=2) == 1


def test_a_dear_exploration_waits_also_when_it_is_the_first():
    """At acceptance 1 the best k is max_k and exploring k = 0 (the least recently used) loses ~80 % of a
    step's tokens: it waits EXPLORE_STEPS * 0.8 / EXPLORE_BUDGET steps even as the first exploration. Only a
    first exploration of max_k above the best k comes at `explore_every` (it finds requests that accept)."""
    policy = DynamicK(MAX_K, SyntheticCost(), explore_every=8, record=True)
    ks = _run(policy, 150, rows=4, accept_p=1.0, rng=random.Random(2))
    assert policy.decisions is not None
    # Before any acceptance is observed the prior (0.5) puts the best k below max_k, so the first exploration
    # drafts max_k at step 8; once max_k is best, none comes in the next 140 steps.
    assert [d.step for d in policy.decisions if d.reason == "explore"] == [8, 9, 10]
    assert ks[15:] == [MAX_K] * 135
    policy = DynamicK(MAX_K, SyntheticCost(), explore_every=8, record=True)
    _run(policy, 40, rows=4, accept_p=0.0, rng=random.Random(2))
    first = next(d for d in policy.decisions if d.reason == "explore")
    assert first.k == MAX_K and first.step <= 16


def test_the_engines_policy_keeps_no_per_step_log():
    """The policy the engine builds records nothing per step: a long-running server must not grow a list per step
    (`record=True` is for benchmarks)."""
    spec = load_config({"speculator": {"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": True}}).speculator
    policy = build_draft_policy(spec)
    assert isinstance(policy, DynamicK)
    _run(policy, 300, rows=4, accept_p=0.7, rng=random.Random(3))
    assert policy.history is None and policy.decisions is None
    recorded = DynamicK(4, SyntheticCost(), record=True)
    assert len(_run(recorded, 50, rows=4, accept_p=0.7, rng=random.Random(3))) == len(recorded.history) == 50
