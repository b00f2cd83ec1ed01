"""The per-slot lists of seen tokens (`samplers.penalty_counts`) and the penalty kernel that walks them.

Under the interpreter on the CPU (compiled on a GPU). The lists are kept by the count kernels (first set bit
appends) through slot reuse, resumed requests, steps with repeated tokens and tokens seen in both prompt and
output; the kernel is checked against `apply_penalties_reference` on small awkward shapes: lists split over
several programs and iterations, in any order, drafts repeated, already listed, unseen or out of vocabulary.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.sampler_cases import make_history

import samplers.penalties
import samplers.penalty_counts
from framework.params.sampling_params import SamplingParams
from samplers.penalties import (
    DraftContext,
    PenaltiesState,
    PenaltyTables,
    apply_penalties_reference,
    apply_penalties_triton,
)
from samplers.penalty_counts import (
    PenaltyCounts,
    seen_bits_reference,
    seen_list_reference,
    update_token_counts_reference,
    update_token_counts_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 70
PENALISED = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=-0.3)


@pytest.fixture
def small_programs(monkeypatch):
    """Lists of a few dozen tokens span several programs, and several iterations of each."""
    monkeypatch.setattr(samplers.penalties, "LIST_BLOCK", 16)
    monkeypatch.setattr(samplers.penalties, "TARGET_PROGRAMS", 6)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _assert_lists_hold_the_seen_set(counts: PenaltyCounts, slots: list[int]) -> None:
    """The list of each slot is its seen set (prompt or counted), each token once; the bitmap agrees."""
    seen = counts.prompt_mask | (counts.output_counts > 0)
    for slot in slots:
        listed = counts.seen_ids[slot, : int(counts.num_seen[slot])].tolist()
        assert sorted(listed) == seen[slot].nonzero().flatten().tolist(), slot
    assert torch.equal(counts.seen_bits[slots], seen_bits_reference(counts.prompt_mask, counts.output_counts)[slots])


def _scenario(forced: bool, monkeypatch) -> list[tuple[PenaltyCounts, torch.Tensor]]:
    """One run of the state through reuse, resumption and steps (Triton kernels if `forced`); after each stage
    (a copy of the counts, the penalised logits of four verification rows of slots 0 and 2)."""
    with monkeypatch.context() as m:
        if forced:
            for module in (samplers.penalties, samplers.penalty_counts):
                m.setattr(module, "use_triton", lambda tensor: True)
        history = make_history(4, 24, DEVICE, num_draft=3)
        state = PenaltiesState(4, VOCAB, torch.device(DEVICE), history)
        logits = (
            torch.linspace(-3, 3, 4 * VOCAB, device=DEVICE)
            .view(4, VOCAB)[:, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))]
            .contiguous()
        )
        idx = _i32([0, 0, 2, 2])
        snapshots = []

        def own(slot: int, tokens: list[int], prompt_len: int, params: SamplingParams) -> None:
            history.all_token_ids[slot, : len(tokens)] = _i32(tokens)
            history.prompt_len[slot], history.prefill_len[slot] = prompt_len, len(tokens)
            history.total_len[slot] = len(tokens)
            state.remove_request(slot)
            state.add_request(slot, params)

        def snapshot() -> None:
            history.draft_tokens[:] = _i32([[50, 50, 3], [1, 2, 3], [61, 4, 61], [0, 0, 0]])
            positions = history.total_len.long()[idx.long()] + torch.tensor([0, 2, 1, 3], device=DEVICE)
            out = state.apply(logits.clone(), idx, positions)
            snapshots.append((PenaltyCounts(*(t.clone() for t in state.counts)), out))

        # Slot 0: a prompt with a repeated token; slot 1 unpenalised; slot 2 resumed (prompt 3, then 3 outputs, one
        # of them a prompt token); slot 3 stays free.
        own(0, [5, 9, 5, 12], 4, PENALISED)
        own(1, [7, 8], 2, SamplingParams())
        own(2, [20, 21, 22, 21, 20, 33], 3, PENALISED)
        state.apply_staged_writes()
        snapshot()
        # Two steps: a row with a repeated token and a token from the prompt, a row sampling nothing, a new one.
        for sampled, num in (
            ([[9, 40, 40], [8, 1, 1], [33, 44, 0]], [3, 2, 2]),
            ([[41, 5, 0], [2, 0, 0], [44, 0, 0]], [2, 1, 0]),
        ):
            state.record_sampled(_i32([0, 1, 2]), torch.tensor(sampled, device=DEVICE), _i32(num))
            history.total_len[[0, 1, 2]] += _i32(num)
        snapshot()
        # Slots 0 and 1 change owners (both penalised now): nothing of the previous owners remains.
        own(0, [60, 61], 1, PENALISED)
        own(1, [3, 3, 3], 3, PENALISED)
        state.apply_staged_writes()
        snapshot()
        return snapshots


def test_lists_follow_rebuilds_steps_and_reuse(monkeypatch, small_programs):
    """Triton kernels (list maintenance and the list-walking penalty kernel) against the references, stage by
    stage; the lists hold exactly the seen set."""
    reference = _scenario(False, monkeypatch)
    triton_run = _scenario(True, monkeypatch)
    for (want, want_logits), (got, got_logits) in zip(reference, triton_run):
        for name in ("output_counts", "prompt_mask", "seen_bits", "num_seen"):
            assert torch.equal(getattr(got, name)[:3], getattr(want, name)[:3]), name
        _assert_lists_hold_the_seen_set(got, [0, 2])
        _assert_lists_hold_the_seen_set(want, [0, 2])
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-6)
    last = triton_run[-1][0]
    _assert_lists_hold_the_seen_set(last, [0, 1, 2])
    assert sorted(last.seen_ids[0, : int(last.num_seen[0])].tolist()) == [60, 61]  # the new owner's tokens only
    assert last.seen_ids[1, : int(last.num_seen[1])].tolist() == [3]
    assert last.output_counts[1].sum() == 0
    slot2 = triton_run[1][0]
    assert sorted(slot2.seen_ids[2, : int(slot2.num_seen[2])].tolist()) == [20, 21, 22, 33, 44]
    assert int(slot2.output_counts[2, 21]) == 1 and bool(slot2.prompt_mask[2, 21])  # prompt and output, listed once
    # The penalties changed the logits (else the comparisons above could not fail).
    assert not torch.equal(triton_run[1][1], triton_run[0][1])


def _tables(vocab: int, max_seen: int, seed: int) -> tuple[PenaltyTables, torch.Tensor, torch.Tensor]:
    """Slots with random counts and prompts (lists shuffled), a penalty-free slot, drafts of every kind."""
    g = torch.Generator().manual_seed(seed)
    slots = 4
    counts = torch.randint(0, 4, (slots, vocab), generator=g, dtype=torch.int32) * (
        torch.rand(slots, vocab, generator=g) < 0.3
    )
    prompt = torch.rand(slots, vocab, generator=g) < 0.2
    if vocab > 1:
        counts[1, 0], prompt[1, 0] = 2, True  # a token in prompt and output
    seen_ids, num_seen = seen_list_reference(prompt, counts, max_seen)
    for slot in range(slots):
        n = int(num_seen[slot])
        seen_ids[slot, :n] = seen_ids[slot, torch.randperm(n, generator=g)]
    unseen = [t for t in range(vocab) if not prompt[0, t] and counts[0, t] == 0] + [vocab + 1]
    listed = int(seen_ids[0, 0]) if num_seen[0] else -1
    drafts = torch.tensor(
        [
            [unseen[0], listed, unseen[0], vocab],
            [-1, vocab - 1, vocab - 1, 0],
            [0, 0, 0, 0],
            [unseen[-1], unseen[0], listed, unseen[0]],
        ],
        dtype=torch.int32,
    )
    total_len = torch.tensor([10, 20, 30, 40], dtype=torch.int32)
    idx = torch.tensor([0, 0, 0, 0, 0, 3, 1, 1, 2, 3, 3], dtype=torch.int32)
    positions = total_len.long()[idx.long()] + torch.tensor([0, 1, 2, 3, 4, 0, 3, 1, 2, 2, 4])
    rep, freq, pres = (
        torch.tensor([1.5, 0.7, 1.0, 1.2]),
        torch.tensor([0.3, 0.0, 0.0, -0.5]),
        torch.tensor([0.2, 1.0, 0.0, 0.4]),
    )  # slot 2: no penalty
    c = PenaltyCounts(counts, prompt, seen_bits_reference(prompt, counts), seen_ids, num_seen)
    tables = PenaltyTables(rep, freq, pres, c, DraftContext(positions, total_len, drafts))
    return tables, idx, positions


@pytest.mark.parametrize("vocab", [1, 37, 200])
@pytest.mark.parametrize("drafts", [False, True])
def test_penalty_kernel_matches_the_reference(vocab, drafts, small_programs):
    tables, idx, _ = _tables(vocab, vocab, seed=vocab)
    move = lambda tup: type(tup)(*(t.to(DEVICE) for t in tup))  # noqa: E731
    tables = tables._replace(
        repetition=tables.repetition.to(DEVICE),
        frequency=tables.frequency.to(DEVICE),
        presence=tables.presence.to(DEVICE),
        counts=move(tables.counts),
        drafts=move(tables.drafts) if drafts else None,
    )
    idx = idx.to(DEVICE)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(len(idx), vocab, generator=g) * 3).to(DEVICE)
    logits[2, ::3] = -float("inf")
    c = tables.counts
    want = apply_penalties_reference(
        logits, idx, tables.repetition, tables.frequency, tables.presence, c.output_counts, c.prompt_mask, tables.drafts
    )
    got = apply_penalties_triton(logits.clone(), idx, tables)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got[8], logits[8])  # slot 2: no penalty
    if vocab > 1:
        assert (got != logits).any(dim=1)[[0, 5, 6]].all()


def test_an_overfull_list_drops_appends_inside_its_row():
    """More distinct tokens than `max_seen` (a slot no penalised owner rebuilt, counting for ever): appends
    past the capacity are dropped, nothing is written outside the row, and readers clamp `num_seen`."""
    runs = []
    for update in (update_token_counts_reference, update_token_counts_triton):
        counts = PenaltyCounts.zeros(3, 40, 4, torch.device(DEVICE))
        counts.seen_ids[2] = -7
        sampled = torch.tensor([[1, 2, 3], [0, 0, 0]], device=DEVICE)
        for step in range(3):
            update(_i32([1, 0]), sampled + 3 * step, _i32([3, 0]), counts)
        assert counts.num_seen.tolist() == [0, 9, 0]
        assert counts.seen_ids[2].tolist() == [-7] * 4 and counts.seen_ids[0].tolist() == [0] * 4
        listed = counts.seen_ids[1].tolist()
        assert len(set(listed)) == 4 and set(listed) <= set(range(1, 10))
        runs.append(counts)
    assert torch.equal(runs[0].output_counts, runs[1].output_counts)
    tables = PenaltyTables(*(torch.full((3,), v, device=DEVICE) for v in (1.0, 0.5, 0.0)), runs[1], None)
    logits = torch.zeros(1, 40, device=DEVICE)
    got = apply_penalties_triton(logits, _i32([1]), tables)
    assert (got[0] == -0.5).sum() == 4  # the listed ones, no read past the row


def test_capacity_bounds_the_distinct_tokens_of_a_history():
    from samplers.penalty_counts import seen_capacity

    assert seen_capacity(151936, 4096, 3) == 4100  # a history of 4096 tokens and one step of k + 1 = 4
    assert seen_capacity(100, 4096, 0) == 100  # never more than the vocabulary
    history = SimpleNamespace(**vars(make_history(2, 30, DEVICE, num_draft=2)))
    state = PenaltiesState(2, 1000, torch.device(DEVICE), history)
    assert state.counts is None  # nothing allocated before a penalised request
    state.add_request(0, PENALISED)
    assert state.counts is not None and state.counts.seen_ids.shape == (3, 33)  # + the dummy slot of full-step graphs


def test_a_slot_re_added_before_the_rebuild_is_counted_once(monkeypatch):
    for module in (samplers.penalties, samplers.penalty_counts):
        monkeypatch.setattr(module, "use_triton", lambda tensor: True)
    history = make_history(2, 8, DEVICE)
    history.all_token_ids[1, :4] = _i32([4, 6, 6, 9])
    history.prompt_len[1], history.prefill_len[1], history.total_len[1] = 2, 4, 4
    state = PenaltiesState(2, 16, torch.device(DEVICE), history)
    state.add_request(1, PENALISED)
    state.remove_request(1)
    state.add_request(1, PENALISED)  # the same slot, again, before apply_staged_writes
    state.apply_staged_writes()
    assert state.counts.output_counts[1].tolist() == [0] * 6 + [1, 0, 0, 1] + [0] * 6
    assert int(state.counts.num_seen[1]) == 3
