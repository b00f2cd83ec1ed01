"""Sampler Triton kernels against their PyTorch references (interpreter on the CPU, real kernels on a GPU).

Awkward cases everywhere: a vocabulary that is not a multiple of the block (blocks are shrunk to 64 so rows
span several), one row, rows in any slot order (and several rows of one slot), -inf logits, ties.
"""

from __future__ import annotations

import pytest
import torch

import samplers.triton_utils
from samplers.allowed_tokens import apply_allowed_tokens_reference, apply_allowed_tokens_triton
from samplers.bad_words import apply_bad_words_reference, apply_bad_words_triton
from samplers.gumbel import (
    gumbel_sample_reference,
    gumbel_sample_triton,
    hash_bits_reference,
    uniform_noise_reference,
)
from samplers.logit_bias import apply_logit_bias_reference, apply_logit_bias_triton
from samplers.logprobs import logprobs_stats_reference, logprobs_stats_triton
from samplers.min_tokens import apply_min_tokens_reference, apply_min_tokens_triton
from samplers.penalties import DraftContext, PenaltyTables, apply_penalties_reference, apply_penalties_triton
from samplers.penalty_counts import (
    PenaltyCounts,
    init_token_counts_reference,
    init_token_counts_triton,
    seen_bits_reference,
    seen_list_reference,
    update_token_counts_reference,
    update_token_counts_triton,
)
from samplers.sanitize import sanitize_logits_reference, sanitize_logits_triton
from samplers.top_k_top_p import (
    apply_min_p_reference,
    apply_min_p_triton,
    apply_top_k_top_p_reference,
    apply_top_k_top_p_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCABS = [1, 37, 200]  # 200 = 3 full blocks of 64 and a partial one
INF = float("inf")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(samplers.triton_utils, "MAX_VOCAB_BLOCK", 64)


def _logits(rows: int, vocab: int, seed: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 2
    if ties:
        x = (x * 2).round() / 2  # many exact ties, -0.0 and +0.0 included
    if vocab > 3 and rows > 2:
        x[1, : vocab // 2] = -INF  # half the row excluded
        x[2] = -INF  # every token excluded
    return x.to(DEVICE)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("vocab", VOCABS)
def test_gumbel_hash_is_bit_exact_and_samples_match(vocab):
    g = torch.Generator().manual_seed(vocab)
    seeds = torch.cat(
        [torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63)]), torch.randint(-(1 << 62), 1 << 62, (5,), generator=g)]
    ).to(DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 1 << 33, 7, 8, 9, 123456], device=DEVICE)
    bits = hash_bits_reference(seeds, positions, vocab)
    assert torch.equal(uniform_noise_reference(seeds, positions, vocab), ((bits >> 8).float() + 0.5) / 2**24)
    logits = _logits(len(seeds), vocab, seed=1)
    assert torch.equal(
        gumbel_sample_triton(logits, seeds, positions), gumbel_sample_reference(logits, seeds, positions)
    )
    one = gumbel_sample_triton(logits[3:4], seeds[3:4], positions[3:4])  # one row
    assert torch.equal(one, gumbel_sample_reference(logits[3:4], seeds[3:4], positions[3:4]))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_top_p_and_min_p_match(vocab, ties):
    rows = 8
    logits = _logits(rows, vocab, seed=vocab + ties, ties=ties)
    top_k = _i32([0, 3, 1, vocab - 1, vocab, 17, 5, 2])
    top_p = torch.tensor([0.37, 1.0, 0.5, 0.9, 0.8, 0.25, 1.0, 0.61], device=DEVICE)
    expected = apply_top_k_top_p_reference(logits, top_k, top_p)
    assert torch.equal(apply_top_k_top_p_triton(logits.clone(), top_k, top_p), expected)
    min_p = torch.tensor([0.0, 0.05, 0.5, 1.0, 0.2, 0.01, 0.3, 0.9], device=DEVICE)
    assert torch.equal(apply_min_p_triton(logits.clone(), min_p), apply_min_p_reference(logits, min_p))
    single = apply_top_k_top_p_triton(logits[5:6].clone(), top_k[5:6], top_p[5:6])
    assert torch.equal(single, expected[5:6])


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]], device=DEVICE)
    for fn in (apply_top_k_top_p_reference, apply_top_k_top_p_triton):
        out = fn(logits.clone(), _i32([2]), torch.tensor([1.0], device=DEVICE))
        assert torch.isfinite(out).tolist() == [[True, False, True, True, False, True]]
        # top-p keeps or drops a tie group whole: 3.0 alone has mass < 0.5, the three 2.0s come together.
        out = fn(logits.clone(), _i32([0]), torch.tensor([0.5], device=DEVICE))
        assert torch.isfinite(out).tolist() == [[True, False, True, True, False, True]]


def _slot_tables():
    """Rows in slot order [2, 0, 2, 1]: slot 2 owns two rows."""
    return _i32([2, 0, 2, 1])


def _counts_of(
    output_counts: torch.Tensor, prompt: torch.Tensor, max_seen: int = 0, shuffle: int = -1
) -> PenaltyCounts:
    """Consistent tables from dense counts and prompt mask (lists in a shuffled order when `shuffle` >= 0)."""
    max_seen = max_seen or output_counts.shape[1]
    seen_ids, num_seen = seen_list_reference(prompt, output_counts, max_seen)
    if shuffle >= 0:
        g = torch.Generator().manual_seed(shuffle)
        for row in range(len(num_seen)):
            n = int(num_seen[row])
            seen_ids[row, :n] = seen_ids[row, torch.randperm(n, generator=g)]
    return PenaltyCounts(output_counts.int(), prompt, seen_bits_reference(prompt, output_counts), seen_ids, num_seen)


def _assert_same_counts(got: PenaltyCounts, want: PenaltyCounts, slots: list[int]) -> None:
    """Equal tables on `slots`; the lists as sets (Triton appends in any order), each token once."""
    for name in ("output_counts", "prompt_mask", "seen_bits", "num_seen"):
        assert torch.equal(getattr(got, name)[slots], getattr(want, name)[slots]), name
    for slot in slots:
        n = int(want.num_seen[slot])
        assert sorted(got.seen_ids[slot, :n].tolist()) == sorted(want.seen_ids[slot, :n].tolist())


@pytest.mark.parametrize("vocab", [37, 200])
def test_penalties_and_counts_match(vocab):
    g = torch.Generator().manual_seed(vocab)
    num_slots, max_len = 3, 40
    all_ids = torch.randint(0, vocab, (num_slots, max_len), generator=g, dtype=torch.int32).to(DEVICE)
    prompt_len, prefill_len = _i32([5, 1, 12]), _i32([9, 1, 30])
    words = (vocab + 31) // 32

    def stale() -> PenaltyCounts:  # a previous owner's tables: a rebuild must keep nothing of them
        return PenaltyCounts(
            torch.full((num_slots, vocab), 7, dtype=torch.int32, device=DEVICE),
            torch.ones(num_slots, vocab, dtype=torch.bool, device=DEVICE),
            torch.full((num_slots, words), -1, dtype=torch.int32, device=DEVICE),
            torch.full((num_slots, max_len + 4), 3, dtype=torch.int32, device=DEVICE),
            torch.full((num_slots,), 5, dtype=torch.int32, device=DEVICE),
        )

    ref, tri = stale(), stale()
    slots = torch.tensor([2, 0], device=DEVICE)  # slot 1 keeps its stale rows: nobody rebuilds it
    init_token_counts_reference(all_ids, prompt_len, prefill_len, slots, ref)
    init_token_counts_triton(all_ids, prompt_len, prefill_len, slots, tri)
    _assert_same_counts(tri, ref, [0, 2])
    sampled = torch.tensor([[4, 4, 9], [1, 2, 3], [vocab - 1, 0, 0]], device=DEVICE)
    idx, num_sampled = _i32([2, 0, 1]), _i32([3, 0, 1])
    update_token_counts_reference(idx, sampled, num_sampled, ref)
    update_token_counts_triton(idx, sampled, num_sampled, tri)
    _assert_same_counts(tri, ref, [0, 2])
    for slot in (0, 2):
        assert torch.equal(tri.seen_bits[slot], seen_bits_reference(tri.prompt_mask, tri.output_counts)[slot])

    logits = _logits(4, vocab, seed=3)
    rep = torch.tensor([1.5, 1.0, 0.7], device=DEVICE)
    freq = torch.tensor([0.0, 0.0, 0.5], device=DEVICE)
    pres = torch.tensor([-0.3, 0.0, 1.0], device=DEVICE)  # slot 1 has no penalty: its stale tables are unread
    expected = apply_penalties_reference(logits, _slot_tables(), rep, freq, pres, ref.output_counts, ref.prompt_mask)
    got = apply_penalties_triton(logits.clone(), _slot_tables(), PenaltyTables(rep, freq, pres, tri, None))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3])


@pytest.mark.parametrize("vocab", [37, 200])
def test_penalties_count_the_drafts_before_each_verification_row(vocab):
    """Verification rows: slot counts + drafts at positions total_len .. p - 1, nothing else.

    Slots in any order: slot 3 verifies 3 drafts (a repeated token, one already in its output), slot 0 none
    though stale drafts sit in its row, slot 1 verifies 2 (a token nobody has seen: the kernel must touch it
    though it is not listed), slot 2 is a prefill chunk (p < total_len), and an out-of-vocabulary draft never
    counts."""
    g = torch.Generator().manual_seed(vocab)
    num_slots, k = 4, 3
    counts = torch.randint(0, 3, (num_slots, vocab), generator=g, dtype=torch.int32)
    counts *= torch.rand(num_slots, vocab, generator=g) < 0.2
    prompt = torch.rand(num_slots, vocab, generator=g) < 0.1
    new_token = next(t for t in range(vocab) if not prompt[1, t] and counts[1, t] == 0)
    seen_token = int(counts[3].argmax())
    drafts = _i32([[5, 6, 7], [new_token, 9 % vocab, vocab + 3], [1, 2, 3], [seen_token, 4, 4]])
    total_len = _i32([10, 20, 30, 40])
    idx = _i32([3, 3, 3, 3, 0, 1, 1, 1, 2])
    positions = torch.tensor([40, 41, 42, 43, 10, 20, 21, 22, 25], device=DEVICE)
    rep = torch.tensor([1.3, 0.8, 1.0, 2.0], device=DEVICE)
    freq = torch.tensor([0.5, 0.0, 0.2, 0.7], device=DEVICE)
    pres = torch.tensor([0.0, 1.0, -0.5, 0.3], device=DEVICE)
    context = DraftContext(positions, total_len, drafts)
    logits = (torch.randn(len(idx), vocab, generator=g) * 2).to(DEVICE)
    logits[4, : vocab // 2] = -INF  # excluded tokens stay excluded
    tables = _counts_of(counts, prompt, shuffle=vocab)
    args = (idx, rep, freq, pres, counts.to(DEVICE), prompt.to(DEVICE))
    expected = apply_penalties_reference(logits, *args, context)
    got = apply_penalties_triton(
        logits.clone(), idx, PenaltyTables(rep, freq, pres, PenaltyCounts(*(t.to(DEVICE) for t in tables)), context)
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # The semantics, row by row: the reference without drafts on counts that include the drafts before it.
    counts, prompt = counts.to(DEVICE), prompt.to(DEVICE)
    for row in range(len(idx)):
        slot = int(idx[row])
        before = min(max(int(positions[row]) - int(total_len[slot]), 0), k)
        row_counts = counts.clone()
        for token in drafts[slot, :before].tolist():
            if token < vocab:
                row_counts[slot, token] += 1
        want = apply_penalties_reference(logits[row : row + 1], idx[row : row + 1], rep, freq, pres, row_counts, prompt)
        torch.testing.assert_close(expected[row : row + 1], want, rtol=0, atol=1e-6)
    # Drafts really change the rows after the first of each group (else this test could not fail).
    plain = apply_penalties_reference(logits, *args)
    changed = (plain != expected).any(dim=1).tolist()
    assert changed == [False, True, True, True, False, False, True, True, False]


def test_bias_allowed_min_tokens_and_bad_words_match():
    vocab = 200
    logits = _logits(4, vocab, seed=5)
    idx = _slot_tables()
    tokens = _i32([[3, 199, 0, 0], [5, 0, 0, 0], [150, 7, 64, 63]])
    values = torch.tensor([[1.0, -2.0, 0, 0], [0.5, 0, 0, 0], [3.0, 4.0, -5.0, 6.0]], device=DEVICE)
    lens = _i32([2, 0, 4])
    assert torch.equal(
        apply_logit_bias_triton(logits.clone(), idx, tokens, values, lens),
        apply_logit_bias_reference(logits, idx, tokens, values, lens),
    )

    enabled = torch.tensor([True, False, True], device=DEVICE)
    mask = torch.rand(3, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE) < 0.3
    assert torch.equal(
        apply_allowed_tokens_triton(logits.clone(), idx, enabled, mask),
        apply_allowed_tokens_reference(logits, idx, enabled, mask),
    )

    positions = torch.tensor([12, 9, 14, 3], device=DEVICE)
    prompt_len, min_tokens = _i32([6, 2, 10]), _i32([4, 1, 5])  # rows: 2 out < 5, 3 < 4, 4 < 5, 1 >= 1
    stop_ids, stop_lens = _i32([[0, 199, 0], [5, 0, 0], [64, 63, 62]]), _i32([2, 1, 3])
    args = (idx, positions, prompt_len, min_tokens, stop_ids, stop_lens)
    expected = apply_min_tokens_reference(logits, *args)
    assert torch.equal(apply_min_tokens_triton(logits.clone(), *args), expected)
    assert (expected[2, [62, 63, 64]] == -INF).all() and torch.equal(expected[3], logits[3])


def test_bad_words_match_with_history_and_drafts():
    vocab, max_len = 50, 32
    history = _history(max_len)
    idx = _i32([2, 0, 2, 1])  # slot 2 owns rows 0 and 2; row 2 samples after a draft token
    positions = torch.tensor([10, 6, 11, 3], device=DEVICE)
    # slot 0: [7, 8, 9], [4]; slot 1: [11], [1, 2, 3], [2, 5]; slot 2: [5, 6], [8], [12, 13, 9]
    words = _i32([[7, 8, 9, 4, 0, 0], [11, 1, 2, 3, 2, 5], [5, 6, 8, 12, 13, 9]])
    ends = _i32([[3, 4, 0], [1, 4, 6], [2, 3, 6]])
    num_words = _i32([2, 3, 3])
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    args = (idx, positions, history, words, ends, num_words, 3)
    expected = apply_bad_words_reference(logits, *args)
    assert torch.equal(apply_bad_words_triton(logits.clone(), *args), expected)
    banned = [((expected == -INF) & (logits != -INF))[row].nonzero().flatten().tolist() for row in range(4)]
    assert banned[0] == [8, 9]  # [8] always; the output ends with [12, 13]
    assert banned[1] == [4, 9]  # [4] always; the output ends with [7, 8]
    assert banned[2] == [8]  # the context ends with draft 8 now: [12, 13] no longer matches
    assert banned[3] == [5, 11]  # [2] ends the output; [1, 2] does too but starts in the prompt


def _history(max_len: int):
    from helpers.sampler_cases import make_history

    history = make_history(3, max_len, DEVICE, num_draft=2)
    rows = {0: [40, 41, 42, 43, 7, 8], 1: [30, 1, 2], 2: [20, 21, 22, 12, 13, 5, 6, 5, 12, 13]}
    prompt = {0: 4, 1: 2, 2: 3}
    for slot, tokens in rows.items():
        history.all_token_ids[slot, : len(tokens)] = _i32(tokens)
        history.prompt_len[slot] = prompt[slot]
        history.prefill_len[slot] = prompt[slot]
        history.total_len[slot] = len(tokens)
    history.draft_tokens[2] = _i32([8, 44])
    return history


@pytest.mark.parametrize("vocab", VOCABS)
def test_sanitize_and_logprobs_stats_match(vocab):
    logits = _logits(5, vocab, seed=11, ties=True)
    if vocab > 3:
        logits[0, 3] = float("nan")
        logits[3, 1] = INF
    out_r, flags_r = sanitize_logits_reference(logits.clone())
    out_t, flags_t = sanitize_logits_triton(logits.clone())
    assert torch.equal(out_r, out_t) and torch.equal(flags_r, flags_t)
    assert flags_r.tolist() == ([True, False, False, True, False] if vocab > 3 else [False] * 5)
    tokens = torch.tensor([0, vocab - 1, 0, vocab // 2, 1 % vocab], device=DEVICE)
    lse_r, chosen_r, rank_r = logprobs_stats_reference(out_r, tokens)
    lse_t, chosen_t, rank_t = logprobs_stats_triton(out_r, tokens)
    torch.testing.assert_close(lse_t, lse_r, rtol=1e-6, atol=1e-6)
    assert torch.equal(chosen_t, chosen_r) and torch.equal(rank_t, rank_r)
