"""Dynamic-k on synthetic costs and acceptance: k = 0 when drafts are useless, large k when they are good, and
it follows a workload whose acceptance or batch size changes mid-run (also when the requests that change are
a few of many)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from framework.config.schema import load_config
from speculators.acceptance import AcceptanceTracker, Removal, RequestAcceptance, fold_queue
from speculators.dynamic import EXPLORE_STEPS, DynamicK, build_draft_policy
from speculators.policy import FixedK
from speculators.step_cost import MeasuredCostModel, batch_bucket, step_costs

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


def test_measured_costs_start_at_max_k_then_fit_a_line():
    cost = MeasuredCostModel()
    policy = DynamicK(4, cost, explore_every=0)
    ids = _ids(16)
    assert policy.choose(ids) == 4  # nothing measured anywhere: the largest k first
    assert policy.choose(ids) == 4
    policy.observe_step(16, 4, 1.31)
    assert policy.costs(16) == pytest.approx([1.0, 1.25, 1.27, 1.29, 1.31])  # the prior shape through it
    assert policy.costs(1) == pytest.approx([1.0, 1.25, 1.27, 1.29, 1.31])  # borrowed by any other bucket
    policy.observe_step(16, 0, 1.0)
    policy.observe_step(16, 4, 1.4)
    policy.observe_step(16, 4, 1.4)  # median of 1.31, 1.4, 1.4
    assert policy.costs(16) == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4])  # a line through both ends
    policy.observe_step(16, 2, 1.05)  # k >= 1 on their own line (least squares), never below k = 0
    assert policy.costs(16) == pytest.approx([1.0, 1.0, 1.05, 1.225, 1.4])
    policy.observe_acceptance(ids, [4] * 16, [4] * 14 + [0] * 2)
    assert policy.choose(ids) == 4
    assert batch_bucket(200) == 256 and batch_bucket(1) == 1 and batch_bucket(10**6) == 4096


def test_a_new_batch_size_borrows_the_nearest_measured_cost_shape():
    cost = MeasuredCostModel()
    cost.observe(16, 0, 1.0)
    cost.observe(16, 4, 2.0)
    assert step_costs(cost, 200, 4) == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0])  # bucket 256: 16's shape
    cost.observe(256, 0, 4.0)  # scaled to what bucket 256 measured itself
    assert step_costs(cost, 200, 4) == pytest.approx([4.0, 5.0, 6.0, 7.0, 8.0])
    assert step_costs(MeasuredCostModel(), 8, 4) is None
    policy = DynamicK(4, cost, explore_every=0)
    assert policy.choose(_ids(200)) in range(5)  # no forced k = 0 / k = 4 measurement at the new size


def test_drafting_has_a_fixed_cost_apart_from_the_line():
    """k = 0 keeps its own cost; k >= 1 share a line: a jump from 0 to 1 (the proposer runs, rows verify) then a
    small slope, as measured on an H200 at batch 1. A line through every k would make k = 1 look cheap and
    keep it (within the switching margin) at acceptance ~0."""
    cost = MeasuredCostModel()
    for k, t in ((0, 1.0), (1, 1.25), (3, 1.29), (5, 1.33)):
        cost.observe(1, k, t)
    assert step_costs(cost, 1, 5) == pytest.approx([1.0, 1.25, 1.27, 1.29, 1.31, 1.33])
    policy = DynamicK(5, cost, explore_every=0)
    ids = _ids(1)
    policy.observe_acceptance(ids, [5], [0])
    assert policy.best_k(ids, current=1) == 0  # k = 0 is 25 % better: leave k = 1
    cost.observe(64, 5, 2.66)  # a bucket with one measurement borrows batch 1's shape, scaled
    assert step_costs(cost, 64, 5) == pytest.approx([2.0, 2.5, 2.54, 2.58, 2.62, 2.66])


def test_costs_are_medians_and_no_k_is_cheaper_than_k0():
    cost = MeasuredCostModel(window=3)
    for seconds in (1.0, 100.0, 1.2):  # one garbage-collection pause among them
        cost.observe(8, 1, seconds)
    assert cost.cost(8, 1) == pytest.approx(1.2)
    cost.observe(8, 1, 1.1)  # the window keeps the last three: 100, 1.2, 1.1
    assert cost.cost(8, 1) == pytest.approx(1.2)
    cost.observe(8, 0, 1.5)  # k = 0 measured slower than k = 1 and 2 (noise): they are raised to it
    cost.observe(8, 2, 1.4)
    assert step_costs(cost, 8, 2) == pytest.approx([1.5] * 3)
    # So with acceptance ~0 the policy keeps k = 0 although k = 1 and 2 measured cheaper.
    policy = DynamicK(2, cost, explore_every=0)
    ids = _ids(8)
    for _ in range(10):
        policy.observe_acceptance(ids, [2] * 8, [0] * 8)
    assert [policy.choose(ids) for _ in range(8)] == [0] * 8


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


def test_a_folded_queue_of_observations_equals_adding_each():
    """A queue of observations and removals folded at once (`fold_queue`) gives the counts of adding every
    observation as it came: also when the batch changes within the queue and when an ended request's id comes
    back as a new request."""
    rng = np.random.default_rng(3)
    batched, each = RequestAcceptance(4, decay=0.9), RequestAcceptance(4, decay=0.9)
    tracker_batched, tracker_each = AcceptanceTracker(4, 0.9, 0.5), AcceptanceTracker(4, 0.9, 0.5)
    batch_a, batch_b = _ids(6), _ids(6)[2:] + ["late"]
    queue: list = []
    for step in range(1, 21):
        if step == 13:  # r0 and r1 end; r1's id returns as a new request with nothing of the old one's counts
            for r in ("r0", "r1"):
                queue.append(Removal(r))
                each.remove(r)
        ids = tuple(batch_a if step < 13 else batch_b + (["r1"] if step > 15 else []))
        drafts = tuple(int(x) for x in rng.integers(0, 5, len(ids)))
        accepted = tuple(int(x) for x in np.minimum(rng.integers(0, 5, len(ids)), drafts))
        if step % 7 == 0:
            continue  # a step without drafts: nothing is queued, nothing decays
        queue.append((ids, drafts, accepted))
        each.observe(ids, drafts, accepted)
        tracker_each.observe(drafts, accepted)
    fold_queue(queue, batched, tracker_batched)
    assert set(batched._row) == set(each._row) == set(batch_b) | {"r1"}
    for r in batched._row:
        assert batched.attempted[batched._row[r]] == pytest.approx(each.attempted[each._row[r]])
        assert batched.accepted[batched._row[r]] == pytest.approx(each.accepted[each._row[r]])
    assert tracker_batched.rates() == pytest.approx(tracker_each.rates())
    assert tracker_batched.attempted.sum() > 0


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


def test_a_bucket_with_costs_of_its_own_is_not_resettled():
    """Back at a batch size whose bucket has measured costs of its own the policy decides once and then every
    DECIDE_EVERY_STEADY steps; at a bucket that only borrows a cost shape it decides every DECIDE_EVERY steps
    while its costs are measured."""
    from speculators.step_cost import has_own_costs

    cost = MeasuredCostModel()
    for k, seconds in ((0, 1.0), (MAX_K, 2.0)):
        for _ in range(3):
            cost.observe(16, k, seconds)
    assert has_own_costs(cost, 16, MAX_K) and not has_own_costs(cost, 256, MAX_K)
    policy = DynamicK(MAX_K, cost, explore_every=0, record=True)
    rng = random.Random(0)
    for rows in (16, 256, 16):  # settles once at the start; at 256 (borrowed costs) again; not back at 16
        for _ in range(40):
            k = _run(policy, 1, rows=rows, accept_p=0.8, rng=rng)[0]
            policy.observe_step(rows, k, 1.0 + 0.001 * rows * (1 + k))  # every step measured
    assert policy.decisions is not None
    decided = [d.step for d in policy.decisions if d.reason == "decide"]
    assert [s for s in decided if s <= 40] == [1, 4, 8, 12, 16, 32]
    assert [s for s in decided if 40 < s <= 80] == [41, 44, 48, 52, 56, 64]
    assert [s for s in decided if s > 80] == [81, 96]


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


def test_steady_steps_are_uniform_decode_steps_at_an_unchanged_k_and_batch():
    """`SteadySteps` (the rule that decides which intervals are a step's cost, beside EXPLORE_STEPS): measured
    only after a step with as many rows at the same k, which proposed that k again, with the device busy and no
    request gone in between."""
    from types import SimpleNamespace

    from speculators.dynamic import SteadySteps

    def out(rows: int, k: int, propose: int, prefill: int = 0) -> SimpleNamespace:
        return SimpleNamespace(
            scheduled_request_ids=_ids(rows),
            num_draft_tokens=[k] * rows,
            num_scheduled_tokens=[1 + k] * (rows - 1) + [1 + k + prefill],
            num_propose_tokens=propose,
        )

    steady = SteadySteps()
    assert steady.measure(out(4, 2, 2), 1.0) is None  # nothing before it
    assert steady.measure(out(4, 2, 2), 1.5) == (4, 2, 0.5)
    assert steady.measure(out(4, 2, 3), 2.0) is None  # proposes another k: the next interval mixes both
    assert steady.measure(out(4, 3, 3), 2.5) is None  # verifies another k than the step before
    assert steady.measure(out(4, 3, 3), 3.0) == (4, 3, 0.5)
    assert steady.measure(out(5, 3, 3), 3.5) is None  # another batch
    assert steady.measure(out(5, 3, 3, prefill=7), 4.0) is None  # a prefill chunk rides along: not uniform
    assert steady.measure(out(5, 3, 3), 4.5) is None  # after a non-uniform step
    assert steady.measure(out(5, 3, 3), 5.0) == (5, 3, 0.5)
    steady.request_left()
    assert steady.measure(out(5, 3, 3), 5.5) is None  # a request ended at the previous output: its host work
    steady.idle()
    assert steady.measure(out(5, 3, 3), 9.0) is None  # the device idled: not a step's cost
    assert steady.measure(out(5, 3, 3), 9.5) == (5, 3, 0.5)
    policy = DynamicK(3, SyntheticCost())
    seen: list[tuple] = []
    policy.observe_step = lambda *a: seen.append(a)  # type: ignore[method-assign]
    for _ in range(3):
        policy.observe_output(out(2, 3, 3))  # type: ignore[arg-type]
    policy.remove_request("r0")  # the scheduler reports an ended request
    policy.observe_output(out(2, 3, 3))  # type: ignore[arg-type]
    policy.device_idled()
    policy.observe_output(out(2, 3, 3))  # type: ignore[arg-type]
    assert [a[:2] for a in seen] == [(2, 3), (2, 3)] and all(a[2] >= 0 for a in seen)
