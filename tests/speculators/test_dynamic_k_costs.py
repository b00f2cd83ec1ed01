"""Dynamic-k's step costs: measured at max k first and then fitted to a line per batch size, a new batch size
borrowing the nearest measured shape, drafting's fixed cost, medians, a folded queue of observations, and which
steps count (uniform decode steps at an unchanged k and batch)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_dynamic_k import MAX_K, SyntheticCost, _ids, _run

from speculators.acceptance import AcceptanceTracker, Removal, RequestAcceptance, fold_queue
from speculators.dynamic import DynamicK
from speculators.step_cost import MeasuredCostModel, batch_bucket, step_costs


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
