"""The fused sampling path (`samplers.fused_sampling`) against the reference pipeline, token for token.

Under the interpreter on the CPU (compiled on a GPU), with blocks of 64 and small candidate buffers so rows
span several chunks and both the candidate path and the exact slow path run. Awkward cases: a vocabulary
that is not a multiple of the block, one token, k = 1, k = V - 1, k >= V, p = 1, tiny p, p close to 1,
min-p, ties, -inf and NaN entries, all -inf rows, greedy rows mixed with random ones, a single row. bf16
logits: test_sampler_fused_bf16.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from helpers.sampler_cases import Slot, make_sampler
from test_sampler_distributions import CONFIGS, LOGITS

import samplers.fused_sampling
import samplers.triton_utils
from framework import SamplingParams
from samplers.fused_cutoff import _bisect_cutoff
from samplers.fused_sampling import sample_fused, sample_fused_triton
from samplers.penalties import DraftContext, PenaltyTables, apply_penalties_reference, apply_penalties_triton
from samplers.penalty_counts import PenaltyCounts, seen_bits_reference, seen_list_reference
from samplers.reference import SlotSamplingParams, sample_reference
from samplers.sanitize import sanitize_logits_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INF = float("inf")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(samplers.triton_utils, "MAX_VOCAB_BLOCK", 64)
    monkeypatch.setattr(samplers.fused_sampling, "CAP", 64)


def _params(vocab: int) -> SlotSamplingParams:
    """Slot s: (temperature, top_k, top_p, min_p). Slot 0 is greedy with filters that must be ignored."""
    rows = [
        (0.0, 3, 0.5, 0.5),
        (1.0, 0, 1.0, 0.0),
        (0.7, 1, 1.0, 0.0),
        (1.3, vocab - 1, 1.0, 0.0),
        (0.3, vocab, 0.9, 0.0),
        (2.0, 50, 1.0, 0.0),
        (0.5, 0, 0.6, 0.0),
        (1.0, 0, 1e-6, 0.0),
        (0.2, 0, 0.999, 0.0),
        (0.9, 0, 1.0, 0.2),
        (1.1, 7, 0.8, 0.05),
        (1.0, 5, 0.3, 0.0),
        (1.5, 0, 0.5, 0.01),
        (0.5, 200, 0.9, 0.0),
    ]
    t, k, p, m = zip(*rows)
    return SlotSamplingParams(
        torch.tensor(t, device=DEVICE),
        torch.tensor(k, dtype=torch.int32, device=DEVICE),
        torch.tensor(p, device=DEVICE),
        torch.tensor(m, device=DEVICE),
        torch.tensor([3, -1, (1 << 63) - 1, 0, 17, 99, 5, 6, 7, 8, 9, 10, 11, 12], device=DEVICE),
    )


def _logits(rows: int, vocab: int, seed: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    if ties:
        x = (x * 2).round() / 2  # many exact ties, -0.0 and +0.0 included
    if vocab > 3:
        x[1, : vocab // 2] = -INF
        x[2] = -INF
        x[3, vocab // 3] = float("nan")
        x[4, 1] = INF
        x[5] = 0.0  # one big tie
    return x.to(DEVICE)


def _check(logits, idx, positions, params, **kwargs):
    expected = sample_reference(logits, idx, positions, params)
    got = sample_fused_triton(logits.clone(), idx, positions, params, **kwargs)
    assert got.sampled.tolist() == expected.sampled.tolist()
    assert got.errors.tolist() == expected.errors.tolist()
    return expected


# Plan shapes (GROUP, CAP, resolve tile): each must stay exact. (Tiles of 8: rows with more candidates take the
# resolve's multi-tile loop.)
PLANS = [(16, 64, 8), (16, 64, 64), (32, 128, 64), (64, 256, 8)]


@pytest.mark.parametrize("vocab,ties", [(1, False), (37, False), (130, True)])
def test_fused_matches_reference(vocab, ties):
    rows = 16
    params = _params(vocab)
    idx = (torch.arange(rows, device=DEVICE) * 5 % len(params.seed)).int()  # every slot, in a mixed order
    positions = torch.arange(rows, device=DEVICE) * 1001 + 3
    logits = _logits(rows, vocab, seed=vocab + ties, ties=ties)
    expected = _check(logits, idx, positions, params)
    if vocab > 3:
        assert expected.errors[2] == 2 and expected.errors[3] == 1 and expected.errors[4] == 1
    _check(logits[7:8], idx[7:8], positions[7:8], params)  # a single row


def test_all_gather_skips_the_sample_kernel_with_the_same_tokens(monkeypatch):
    """Every row gathers (top-k and/or top-p, random): `all_gather=True` launches no sample kernel and samples
    the reference's tokens, NaN/+inf rows flagged by the first pass included."""
    vocab, rows = 130, 12
    params = _params(vocab)
    gather_slots = [2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13]  # slot 4: top_k = vocab (off) but top-p on
    idx = torch.tensor([gather_slots[i % len(gather_slots)] for i in range(rows)], dtype=torch.int32, device=DEVICE)
    positions = torch.arange(rows, device=DEVICE) * 13 + 2
    logits = _logits(rows, vocab, seed=5, ties=True)
    launched = []
    real = samplers.fused_sampling._fused_sample_kernel
    monkeypatch.setattr(
        samplers.fused_sampling,
        "_fused_sample_kernel",
        type("Spy", (), {"__getitem__": lambda self, grid: launched.append(grid) or real[grid]})(),
    )
    expected = _check(logits, idx, positions, params, all_gather=True)
    assert not launched and expected.errors[3] == 1 and expected.errors[4] == 1
    _check(logits, idx, positions, params)
    assert launched  # (the spy sees launches)
    with pytest.raises(ValueError, match="all_gather"):
        sample_fused_triton(logits, idx, positions, params, need_plan=False, all_gather=True)


def test_stages_tell_when_every_row_gathers():
    """`SamplingStages.all_gather` is True only when every request is random with top-k < vocab or top-p < 1."""
    vocab = 50
    cases = [
        ([SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.5, top_p=0.9)], True),
        ([SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.0, top_k=5)], False),
        ([SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, min_p=0.1)], False),
        ([SamplingParams(temperature=1.0, top_k=vocab)], False),  # top-k of the whole vocabulary is off
        ([SamplingParams(temperature=1.0, top_k=vocab, top_p=0.5)], True),
    ]
    for params, want in cases:
        sampler, _ = make_sampler([Slot(p, [1, 2]) for p in params], vocab)
        assert sampler.states.stages_for(np.arange(len(params))).all_gather is want, params


@pytest.mark.parametrize("group,cap,tile", PLANS)
def test_plan_variants_match_reference(monkeypatch, group, cap, tile):
    """Every plan shape samples the reference's tokens: candidate rows, overflowing ones (k = 200 > CAP / GROUP
    groups) and the exact path."""
    for name, value in (("GROUP", group), ("CAP", cap), ("RESOLVE_TILE", tile)):
        monkeypatch.setattr(samplers.fused_sampling, name, value)
    vocab, rows = 300, 24
    params = _params(vocab)
    # Slots 2, 10 and 11 (k = 1, 7, 5: a cutoff on a group max, which must stay chosen) on most rows.
    idx = torch.tensor([2, 10, 11] * 6 + [3, 4, 5, 6, 8, 13], dtype=torch.int32, device=DEVICE)
    logits = _logits(rows, vocab, seed=group, ties=True)
    logits[6:12, ::7] += 9.0  # peaked rows: a few dozen tokens far above the rest
    _check(logits, idx, torch.arange(rows, device=DEVICE) * 7 + 1, params)


@pytest.mark.parametrize("group,cap,tile", PLANS)
def test_plan_gathers_exactly_the_tokens_above_its_cutoff(monkeypatch, group, cap, tile):
    """The plan's cutoff c (`ws.cutoff`) and candidates: every finite token with x >= c and nothing else, and c
    keeps k tokens for top-k."""
    for name, value in (("GROUP", group), ("CAP", cap), ("RESOLVE_TILE", tile)):
        monkeypatch.setattr(samplers.fused_sampling, name, value)
    vocab, rows = 300, 8
    params = _params(vocab)
    idx = torch.tensor([2, 10, 11, 5, 6, 12, 10, 2], dtype=torch.int32, device=DEVICE)  # top-k, top-p alone
    logits = _logits(rows, vocab, seed=group + 1, ties=True)
    logits[4:, ::9] += 9.0
    launches = []
    real = samplers.fused_sampling._launch_plan
    monkeypatch.setattr(
        samplers.fused_sampling, "_launch_plan", lambda *a, **k: launches.append((a, k)) or real(*a, **k)
    )
    sample_fused_triton(logits, idx, torch.arange(rows, device=DEVICE), params)
    args, kwargs = launches[0]
    ws = args[3]
    real(*args, **kwargs)  # the plan again, its outputs left as they are (the resolve reads them only)
    cutoffs = ws.cutoff.clone()
    x = sanitize_logits_reference(logits.clone())[0]
    for row in range(rows):
        n = int(ws.count[row])
        above = (x[row] >= cutoffs[row]) & (x[row] > -INF)
        k = int(params.top_k[idx[row]])
        if 0 < k < int((x[row] > -INF).sum()):
            assert int(above.sum()) >= k
        assert n == int(above.sum())
        if n <= cap:
            tokens = ws.cand_token[row * cap : row * cap + n]
            assert sorted(tokens.tolist()) == above.nonzero().flatten().tolist()
            assert torch.equal(ws.cand_value[row * cap : row * cap + n], x[row, tokens.long()])


def test_fused_with_an_earlier_sanitize_and_without_a_plan():
    vocab, rows = 200, 10
    params = _params(vocab)
    logits = _logits(rows, vocab, seed=1, ties=False)
    logits, nonfinite = sanitize_logits_reference(logits)
    idx = torch.tensor([0, 1, 0, 1, 1, 0, 2, 3, 4, 5], dtype=torch.int32, device=DEVICE)
    positions = torch.arange(rows, device=DEVICE)
    for slots, need_plan in ((idx, True), (idx % 2, False)):  # slots 0 and 1 need no top-k/top-p/min-p
        expected = sample_reference(logits, slots, positions, params)
        got = sample_fused_triton(
            logits, slots, positions, params, sanitize=False, nonfinite=nonfinite, need_plan=need_plan
        )
        assert got.sampled.tolist() == expected.sampled.tolist()
        assert got.errors.tolist() == torch.where(nonfinite, 1, expected.errors).tolist()


def test_overflowing_and_uncovered_rows_take_the_exact_path(monkeypatch):
    """A buffer of 16: k = 5 may need 80 candidates; top-p alone gathers one group and must look further."""
    monkeypatch.setattr(samplers.fused_sampling, "CAP", 16)
    monkeypatch.setattr(samplers.fused_sampling, "GROUP", 16)  # groups of one buffer each
    vocab, rows = 150, 6
    params = _params(vocab)
    logits = _logits(rows, vocab, seed=4, ties=True) / 4  # flat rows: top-p sets reach far below the max
    idx = torch.tensor([11, 10, 13, 12, 8, 4], dtype=torch.int32, device=DEVICE)
    _check(logits, idx, torch.arange(rows, device=DEVICE) + 40, params)


@pytest.mark.parametrize("logprobs", [2, None])
def test_sampler_fused_equals_unfused_with_edits(logprobs):
    """Bias and penalties (step 1 folded into the fused kernels without logprobs), masks, NaN rows."""
    vocab = 90
    slots = [
        Slot(
            SamplingParams(
                temperature=0.8,
                top_k=10,
                top_p=0.9,
                repetition_penalty=1.3,
                presence_penalty=0.4,
                logprobs=logprobs,
                seed=1,
            ),
            prompt=[1, 2, 3],
            output=[4, 4],
            seed=1,
        ),
        Slot(SamplingParams(temperature=0.0, logit_bias={7: 5.0}, logprobs=logprobs), prompt=[5]),
        Slot(SamplingParams(temperature=1.2, min_p=0.1, logit_bias={3: -2.0}, seed=3), prompt=[4], seed=3),
    ]
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2))
    logits[4, 3] = float("nan")
    logits[1, 9] = float("inf")
    idx = torch.tensor([0, 1, 2, 0, 2], dtype=torch.int32)
    positions = torch.tensor([5, 1, 1, 6, 2])
    outs = []
    for fused in (False, True):
        sampler, _ = make_sampler(slots, vocab)
        sampler.fused = fused
        outs.append(sampler(logits.clone(), idx, positions, sampler.states.stages_for(np.arange(3))))
    assert outs[0].sampled_token_ids.tolist() == outs[1].sampled_token_ids.tolist()
    assert outs[0].errors.tolist() == outs[1].errors.tolist() == [0, 1, 0, 0, 1]
    assert (outs[0].logprobs is None) == (outs[1].logprobs is None) == (logprobs is None)
    if logprobs is not None:
        for a, b in zip(outs[0].logprobs, outs[1].logprobs):
            assert torch.equal(a, b)


def test_distribution_configs_match_the_reference_row_for_row():
    """The chi-square configurations, 12 draws each through the fused path, equal the reference's draws
    (the chi-square itself runs at 120,000 draws per configuration on the GPU, tests/gpu)."""
    n = 12
    names = list(CONFIGS)
    slots = [Slot(SamplingParams(**CONFIGS[name]), prompt=[0], seed=1000 + i) for i, name in enumerate(names)]
    sampler, _ = make_sampler(slots, len(LOGITS))
    params = sampler.states.params.slot_params
    idx = torch.arange(len(names), dtype=torch.int32).repeat_interleave(n)
    positions = torch.arange(n).repeat(len(names)) + 1
    _check(LOGITS.expand(len(idx), -1).clone(), idx, positions, params)


@triton.jit
def _cutoff_probe_kernel(keys_ptr, out_ptr, num, want, limit, GROUPS: tl.constexpr):
    groups = tl.arange(0, GROUPS)
    valid = groups < num
    keys = tl.load(keys_ptr + groups, mask=valid, other=-2147483648)  # lanes past: below every key, as required
    key, count = _bisect_cutoff(keys, valid, num, want, limit)
    tl.store(out_ptr, key)
    tl.store(out_ptr + 1, count)


def _keys(x: torch.Tensor) -> torch.Tensor:
    """`_ordered_key` in PyTorch."""
    bits = x.view(torch.int32)
    return torch.where(x == 0, 0, torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)).int()


@pytest.mark.parametrize("kind", ["spread", "narrow", "ties", "negative", "infinite", "huge"])
def test_cutoff_counts(kind):
    """The plan's cutoff: `want <= count(keys >= c)`, and `<= limit` unless ties at the largest such c forbid it;
    narrow rows (values a few ulps apart), huge ones (+-3e38)."""
    g = torch.Generator().manual_seed(len(kind))
    num = 300
    x = torch.randn(num, generator=g) * 3
    if kind == "narrow":
        x = (1.0 + torch.randint(0, 40, (num,), generator=g) * 2.0**-23).float()
    elif kind == "ties":
        x = (x * 2).round() / 2
    elif kind == "negative":
        x = -x.abs() - 1e-3
    elif kind == "infinite":
        x[::3] = -INF
    elif kind == "huge":
        x = x * 1e37  # +-3e38: the value span is infinite
        x[:5] = torch.tensor([1e-30, -1e-30, 0.0, -0.0, 3.0e38])
    keys = _keys(x)
    for want, limit in ((1, 1), (1, 4), (5, 8), (50, 64), (64, 64), (200, 250), (300, 300)):
        out = torch.zeros(2, dtype=torch.int32)
        _cutoff_probe_kernel[(1,)](keys, out, num, want, limit, GROUPS=512)
        key, count = out.tolist()
        assert count == int((keys >= key).sum()) >= want
        if count > limit:  # only ties at the largest qualifying key may leave too many
            assert key in keys.tolist() and int((keys > key).sum()) < want


@pytest.mark.parametrize("drafts,sanitize", [(False, True), (True, False)])
def test_penalty_kernel_then_the_fused_passes(drafts, sanitize):
    """The penalty kernel (listed tokens only, drafts before verification rows counted) leaves the logits
    penalised in place exactly as `apply_penalties_reference`, and the fused passes sample the reference's
    tokens from them."""
    vocab, rows = 130, 16
    params = _params(vocab)
    slots = len(params.seed)
    g = torch.Generator().manual_seed(7)
    counts = torch.randint(0, 3, (slots, vocab), generator=g, dtype=torch.int32) * (
        torch.rand(slots, vocab, generator=g) < 0.2
    )
    prompt = torch.rand(slots, vocab, generator=g) < 0.1
    on = torch.arange(slots) % 3 != 2  # some slots without penalties
    tables = PenaltyTables(
        torch.where(on, 1.0 + torch.rand(slots, generator=g), 1.0),
        torch.where(on, 0.3, 0.0),
        torch.where(on, torch.rand(slots, generator=g), 0.0),
        PenaltyCounts(
            counts.int(), prompt, seen_bits_reference(prompt, counts), *seen_list_reference(prompt, counts, 64)
        ),
        None,
    )
    positions = torch.arange(rows) * 3 + 10
    if drafts:
        tables = tables._replace(
            drafts=DraftContext(
                positions,
                torch.randint(5, 60, (slots,), generator=g, dtype=torch.int32),
                torch.randint(-1, vocab, (slots, 3), generator=g, dtype=torch.int32),
            )
        )
    tables = tables._replace(
        counts=PenaltyCounts(*(t.to(DEVICE) for t in tables.counts)),
        drafts=tables.drafts and DraftContext(*(t.to(DEVICE) for t in tables.drafts)),
    )
    tables = PenaltyTables(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tables))
    idx = (torch.arange(rows, device=DEVICE) * 5 % slots).int()
    logits = _logits(rows, vocab, seed=3, ties=True)
    nonfinite = None
    if not sanitize:
        logits, nonfinite = sanitize_logits_reference(logits)
    penalised = apply_penalties_reference(
        logits, idx, *tables[:3], tables.counts.output_counts, tables.counts.prompt_mask, tables.drafts
    )
    expected = sample_reference(penalised, idx, positions.to(DEVICE), params)
    got_logits = apply_penalties_triton(logits.clone(), idx, tables)
    got = sample_fused_triton(got_logits, idx, positions.to(DEVICE), params, sanitize=sanitize, nonfinite=nonfinite)
    assert torch.equal(got_logits.nan_to_num(), penalised.nan_to_num())
    assert got.sampled.tolist() == expected.sampled.tolist()
    flagged = expected.errors if nonfinite is None else torch.where(nonfinite, 1, expected.errors)
    assert got.errors.tolist() == flagged.tolist()


def test_sample_fused_is_the_fused_path_or_the_reference():
    """The V1 runner's entry point: the fused kernels when asked (CUDA tensors by default), else the reference;
    the same tokens and errors either way, and the host hints (`need_plan`, `all_gather`) reach the kernels."""
    vocab, rows = 130, 10
    params = _params(vocab)
    idx = torch.tensor([2, 3, 4, 5, 6, 7, 8, 10, 11, 12], dtype=torch.int32, device=DEVICE)  # every row gathers
    positions = torch.arange(rows, device=DEVICE) * 3
    logits = _logits(rows, vocab, seed=9, ties=False)
    expected = sample_reference(logits, idx, positions, params)
    for fused, kwargs in ((False, {}), (True, {}), (True, dict(all_gather=True))):
        got = sample_fused(logits.clone(), idx, positions, params, fused=fused, **kwargs)
        assert got.sampled.tolist() == expected.sampled.tolist() and got.errors.tolist() == expected.errors.tolist()
    with pytest.raises(ValueError, match="all_gather"):
        sample_fused(logits, idx, positions, params, fused=True, need_plan=False, all_gather=True)
    # The hints that skip stages: slots 0 (greedy) and 1 (random, no filter) need no plan, slot 0 alone no noise.
    for slots, hints in (([0, 1, 1, 0], dict(need_plan=False)), ([0, 0], dict(any_random=False, need_plan=False))):
        sub = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        want = sample_reference(logits[: len(slots)], sub, positions[: len(slots)], params)
        for fused in (False, True):
            got = sample_fused(logits[: len(slots)].clone(), sub, positions[: len(slots)], params, fused=fused, **hints)
            assert got.sampled.tolist() == want.sampled.tolist() and got.errors.tolist() == want.errors.tolist()
