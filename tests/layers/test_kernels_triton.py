"""Triton input-preparation kernels against their PyTorch references (interpreter on the CPU, real on a GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from framework.layers.kernels.block_table import (
    compute_kv_slot_mapping_reference,
    compute_kv_slot_mapping_triton,
    gather_block_tables_reference,
    gather_block_tables_triton,
)
from framework.layers.kernels.input_prep import (
    compute_num_sampled_reference,
    compute_num_sampled_triton,
    post_update_reference,
    post_update_triton,
    prepare_inputs_reference,
    prepare_inputs_triton,
    token_batch_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def random_step(seed: int, num_slots: int, num_rows: int, max_len: int, k: int, decode_only=False, prefill_only=False):
    """A random but consistent slot table and one step over `num_rows` slots in random order."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    all_ids = torch.randint(0, 50_000, (num_slots, max_len), generator=g, dtype=torch.int32)
    prefill = [rng.randint(1, max_len - k - 2) for _ in range(num_slots)]
    computed = []
    for p in prefill:
        decode = decode_only or (not prefill_only and rng.random() < 0.5)
        computed.append(rng.randint(p, max_len - k - 2) if decode else rng.randint(0, p - 1))
    slots = rng.sample(range(num_slots), num_rows)
    n_sched, n_draft = [], []
    for s in slots:
        if computed[s] >= prefill[s]:
            d = rng.randint(0, k)
            n_draft.append(d)
            n_sched.append(1 + d)
        else:
            n_draft.append(0)
            n_sched.append(rng.randint(1, prefill[s] - computed[s]))
    qsl = [0]
    for n in n_sched:
        qsl.append(qsl[-1] + n)
    cu = [0]
    for d in n_draft:
        cu.append(cu[-1] + d + 1)
    state = dict(
        all_token_ids=all_ids.to(DEVICE),
        prefill_len=_i32(prefill),
        num_computed=_i32(computed),
        last_sampled=torch.randint(0, 50_000, (num_slots,), generator=g, dtype=torch.int32).to(DEVICE),
        draft_tokens=torch.randint(0, 50_000, (num_slots, k), generator=g, dtype=torch.int32).to(DEVICE),
    )
    step = dict(
        idx_mapping=_i32(slots),
        query_start_loc=_i32(qsl),
        cu_num_logits=_i32(cu),
        num_tokens=qsl[-1],
        num_logits=cu[-1],
    )
    return state, step, n_draft


CASES = [
    dict(seed=0, num_slots=8, num_rows=5, max_len=64, k=3),
    dict(seed=1, num_slots=3, num_rows=1, max_len=300, k=0),  # a single request, long prefill (> BLOCK)
    dict(seed=2, num_slots=6, num_rows=6, max_len=40, k=2, decode_only=True),  # no prefill rows
    dict(seed=3, num_slots=6, num_rows=4, max_len=40, k=0, prefill_only=True),  # no decode rows
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c['seed']}")
def test_prepare_inputs_triton_matches_reference(case):
    state, step, n_draft = random_step(**case)
    ref = prepare_inputs_reference(**step, **state)
    got, token_rows = prepare_inputs_triton(**step, **state, max_logits_per_row=max(n_draft) + 1)
    for name in ref._fields:
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name).cpu().to(getattr(got, name).dtype)), name
    assert torch.equal(token_rows, token_batch_rows(step["query_start_loc"], step["num_tokens"]))


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"seed{c['seed']}")
def test_num_sampled_and_post_update_triton(case):
    state, step, n_draft = random_step(**case)
    prepared = prepare_inputs_reference(**step, **state)
    rows = step["idx_mapping"].numel()
    g = torch.Generator().manual_seed(case["seed"])
    drafts = torch.tensor(n_draft, dtype=torch.int32, device=DEVICE)
    accepted = (torch.rand(rows, generator=g).to(DEVICE) * (drafts + 1).float()).int().clamp(max=drafts)
    ref_counts = compute_num_sampled_reference(
        step["idx_mapping"], prepared.seq_lens, state["prefill_len"], accepted, drafts
    )
    got_counts = compute_num_sampled_triton(
        step["idx_mapping"], prepared.seq_lens, state["prefill_len"], accepted, drafts
    )
    assert all(torch.equal(a, b) for a, b in zip(ref_counts, got_counts))
    sampled = torch.randint(0, 50_000, (rows, case["k"] + 1), generator=g).to(DEVICE)
    query_lens = step["query_start_loc"][1:] - step["query_start_loc"][:-1]
    total_len = state["prefill_len"].clone() + 1
    ref_state = {n: t.clone() for n, t in state.items()}
    ref_total = total_len.clone()
    post_update_reference(
        step["idx_mapping"],
        query_lens,
        sampled,
        *ref_counts,
        ref_state["all_token_ids"],
        ref_total,
        ref_state["num_computed"],
        ref_state["last_sampled"],
    )
    post_update_triton(
        step["idx_mapping"],
        query_lens,
        sampled,
        *got_counts,
        state["all_token_ids"],
        total_len,
        state["num_computed"],
        state["last_sampled"],
    )
    assert torch.equal(total_len, ref_total)
    for name in ("all_token_ids", "num_computed", "last_sampled"):
        assert torch.equal(state[name], ref_state[name]), name


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_table_gather_and_slot_mapping_triton(block_size):
    g = torch.Generator().manual_seed(block_size)
    table = torch.randint(0, 10_000, (7, 600), generator=g, dtype=torch.int32).to(DEVICE)  # > one 512-column tile
    idx_mapping = _i32([6, 0, 3])
    assert torch.equal(
        gather_block_tables_triton(idx_mapping, table), gather_block_tables_reference(idx_mapping, table)
    )
    batch = gather_block_tables_reference(idx_mapping, table)
    token_rows = torch.tensor([0, 0, 1, 2, 2, 2], device=DEVICE)
    positions = torch.tensor([0, 5, 17, 3, 4, 599 * block_size], device=DEVICE)
    ref = compute_kv_slot_mapping_reference(token_rows, positions, batch, block_size, num_padded_tokens=8)
    got = compute_kv_slot_mapping_triton(token_rows, positions, batch, block_size, num_padded_tokens=8)
    assert torch.equal(got, ref) and got[-2:].tolist() == [-1, -1]


def test_scatter_triton_matches_reference():
    from framework.layers.kernels.scatter import scatter_reference, scatter_triton

    target = torch.zeros(7, 300, dtype=torch.int32, device=DEVICE)
    expected = target.clone()
    index = torch.tensor([0, 5, 299, 2100 - 1, 1500], device=DEVICE)
    values = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32, device=DEVICE)
    scatter_reference(expected, index, values)
    scatter_triton(target, index, values)
    assert torch.equal(target, expected) and int(expected.view(-1)[2099]) == 4


def test_staged_writes_last_write_wins():
    """A position staged twice before an apply (slot reused, or writes left by a failed step) keeps the last value."""
    from framework.batch.staged_writes import StagedWrites

    target = torch.zeros(4, 8, dtype=torch.int32, device=DEVICE)
    staged = StagedWrites(target)
    staged.stage(2, [1, 2, 3])
    staged.stage(1, [9])
    staged.stage(2, [7, 8], column=1)  # overwrites columns 1..2 of slot 2
    staged.apply()
    assert target[2, :4].tolist() == [1, 7, 8, 0] and target[1, 0].item() == 9
