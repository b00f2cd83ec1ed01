"""Reference kernels against naive per-token loops written from the spec (the Triton kernels match these)."""

from __future__ import annotations

import math

import pytest
import torch

from framework.layers.kernels.block_table import compute_kv_slot_mapping_reference, gather_block_tables_reference
from framework.layers.kernels.input_prep import (
    compute_num_sampled_reference,
    post_update_reference,
    prepare_inputs_reference,
)
from samplers.gumbel import gumbel_sample_reference, mix32, uniform_noise_reference
from samplers.top_k_top_p import apply_min_p_reference, apply_top_k_top_p_reference


def _state(num_slots=6, max_len=32, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        all_token_ids=torch.randint(0, 1000, (num_slots, max_len), generator=g, dtype=torch.int32),
        prefill_len=torch.tensor([10, 5, 20, 7, 3, 9], dtype=torch.int32)[:num_slots],
        num_computed=torch.tensor([4, 5, 0, 7, 0, 9], dtype=torch.int32)[:num_slots],
        last_sampled=torch.randint(0, 1000, (num_slots,), generator=g, dtype=torch.int32),
        draft_tokens=torch.randint(0, 1000, (num_slots, k), generator=g, dtype=torch.int32),
    )


def test_prepare_inputs_matches_naive_loop():
    st = _state()
    # rows: slot 2 prefill chunk of 8, slot 1 decode + 2 drafts, slot 0 prefill remainder 6, slot 3 decode
    idx_mapping = torch.tensor([2, 1, 0, 3], dtype=torch.int32)
    n_sched = [8, 3, 6, 1]
    n_draft = [0, 2, 0, 0]
    qsl = torch.tensor([0, 8, 11, 17, 18], dtype=torch.int32)
    cu_logits = torch.tensor([0, 1, 4, 5, 6], dtype=torch.int32)
    out = prepare_inputs_reference(idx_mapping, qsl, cu_logits, 18, 6, **st)

    ids, pos, logits_idx, exp_map, sample_pos = [], [], [], [], []
    for row, slot in enumerate(idx_mapping.tolist()):
        start = int(st["num_computed"][slot])
        decode = start >= int(st["prefill_len"][slot])
        for j in range(n_sched[row]):
            pos.append(start + j)
            if not decode:
                ids.append(int(st["all_token_ids"][slot, start + j]))
            else:
                ids.append(int(st["last_sampled"][slot]) if j == 0 else int(st["draft_tokens"][slot, j - 1]))
        end = int(qsl[row + 1])
        for k in range(n_draft[row] + 1):
            t = end - (n_draft[row] + 1) + k
            logits_idx.append(t)
            exp_map.append(slot)
            sample_pos.append(pos[t] + 1)
    assert out.input_ids.tolist() == ids
    assert out.positions.tolist() == pos
    assert out.seq_lens.tolist() == [int(st["num_computed"][s]) + n for s, n in zip(idx_mapping.tolist(), n_sched)]
    assert out.logits_indices.tolist() == logits_idx
    assert out.expanded_idx_mapping.tolist() == exp_map
    assert out.sample_positions.tolist() == sample_pos


def test_num_sampled_and_post_update():
    st = _state()
    total_len = st["prefill_len"].clone()
    idx_mapping = torch.tensor([2, 1, 0], dtype=torch.int32)
    query_lens = torch.tensor([8, 3, 6], dtype=torch.int32)
    seq_lens = st["num_computed"][idx_mapping.long()] + query_lens  # [8, 8, 10]
    num_accepted = torch.tensor([0, 1, 0], dtype=torch.int32)
    num_draft = torch.tensor([0, 2, 0], dtype=torch.int32)
    num_sampled, num_rejected = compute_num_sampled_reference(
        idx_mapping, seq_lens, st["prefill_len"], num_accepted, num_draft
    )
    # slot 2: chunk ends at 8 < prefill 20 -> nothing; slot 1: decode, 1 of 2 drafts accepted; slot 0: done.
    assert num_sampled.tolist() == [0, 2, 1]
    assert num_rejected.tolist() == [0, 1, 0]
    sampled = torch.tensor([[11, 0, 0], [21, 22, 0], [31, 0, 0]])
    before = {k: v.clone() for k, v in st.items()}
    before_total = total_len.clone()
    post_update_reference(
        idx_mapping,
        query_lens,
        sampled,
        num_sampled,
        num_rejected,
        st["all_token_ids"],
        total_len,
        st["num_computed"],
        st["last_sampled"],
    )
    assert st["num_computed"].tolist()[:3] == [4 + 6, 5 + 3 - 1, 0 + 8]
    assert total_len.tolist()[:3] == [before_total[0] + 1, before_total[1] + 2, before_total[2]]
    assert st["all_token_ids"][1, 5:7].tolist() == [21, 22]
    assert st["all_token_ids"][0, 10].item() == 31
    assert torch.equal(st["all_token_ids"][2], before["all_token_ids"][2])  # nothing sampled, nothing written
    assert st["last_sampled"].tolist()[:3] == [31, 22, int(before["last_sampled"][2])]
    assert torch.equal(st["num_computed"][3:], before["num_computed"][3:])  # unscheduled slots untouched


def test_block_table_gather_and_kv_slots():
    table = torch.tensor([[7, 3, 0], [1, 2, 5], [4, 6, 8]], dtype=torch.int32)
    idx_mapping = torch.tensor([2, 0], dtype=torch.int32)
    batch = gather_block_tables_reference(idx_mapping, table)
    assert batch.tolist() == [[4, 6, 8], [7, 3, 0]]
    rows = torch.tensor([0, 0, 1])
    positions = torch.tensor([3, 4, 5])
    slots = compute_kv_slot_mapping_reference(rows, positions, batch, block_size=4, num_padded_tokens=5)
    assert slots.tolist() == [4 * 4 + 3, 6 * 4 + 0, 3 * 4 + 1, -1, -1]


def test_mix32_is_a_bijection_on_a_sample_and_matches_python():
    def py_mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = torch.tensor([0, 1, 2, 12345, 0xFFFFFFFF, 0x80000000, 987654321])
    assert mix32(xs).tolist() == [py_mix(int(x)) for x in xs]


def test_noise_is_keyed_by_seed_and_position_only():
    seeds = torch.tensor([5, 5, 6])
    positions = torch.tensor([10, 11, 10])
    u = uniform_noise_reference(seeds, positions, 64)
    assert torch.equal(u[0], uniform_noise_reference(torch.tensor([5]), torch.tensor([10]), 64)[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (u > 0).all() and (u < 1).all()


def test_gumbel_max_samples_the_softmax_distribution():
    """Chi-square goodness of fit over 20,000 deterministic draws (a fixed statistic, not a flaky test)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20_000
    draws = gumbel_sample_reference(logits.expand(n, -1), torch.full((n,), 42), torch.arange(n))
    counts = torch.bincount(draws, minlength=6).double()
    expected = torch.softmax(logits.double(), 0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001


def test_top_k_top_p_and_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4))
    top_k = torch.tensor([0, 2, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.7, 0.71], dtype=torch.float32)
    out = apply_top_k_top_p_reference(logits, top_k, top_p)
    kept = torch.isfinite(out).tolist()
    assert kept[0] == [True] * 5
    assert kept[1] == [True, True, False, False, False]
    assert kept[2] == [True, True, False, False, False]  # 0.5 + 0.2 reaches 0.7
    assert kept[3] == [True, True, True, False, False]
    assert torch.equal(out[0], logits[0])
    # Kept iff p >= min_p * p_max (away from the exact boundary, where float rounding decides).
    mp = apply_min_p_reference(logits[:2], torch.tensor([0.29, 0.31]))
    assert torch.isfinite(mp).tolist() == [[True, True, True, False, False], [True, True, False, False, False]]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2)])
def test_paged_attention_matches_dense_causal(num_heads, num_kv_heads):
    from framework.layers.attention import AttentionMetadata, paged_attention_reference, store_kv_reference

    torch.manual_seed(0)
    d, bs, nblocks = 8, 4, 16
    cache = torch.zeros(2, nblocks, bs, num_kv_heads, d)
    seq = 11
    table = torch.tensor([[5, 2, 9]], dtype=torch.int32)
    q = torch.randn(seq, num_heads, d)
    k = torch.randn(seq, num_kv_heads, d)
    v = torch.randn(seq, num_kv_heads, d)
    pos = torch.arange(seq)
    slots = table[0, pos // bs].long() * bs + pos % bs
    store_kv_reference(k, v, cache, slots)
    meta = AttentionMetadata(
        seq,
        1,
        torch.tensor([0, seq], dtype=torch.int32),
        torch.tensor([seq], dtype=torch.int32),
        table,
        slots,
        bs,
        seq,
        seq,
    )
    out = paged_attention_reference(q, cache, meta, scale=1 / math.sqrt(d))
    rep = num_heads // num_kv_heads
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    dense = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
