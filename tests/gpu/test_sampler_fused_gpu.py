"""The fused sampling path on a GPU at real shapes (skipped without CUDA).

Run on the GPU machine: `python -m pytest -q tests/gpu/test_sampler_fused_gpu.py` (about a minute, most of it
compiling the kernels and the 960,000-row chi-square batch).

On a GPU the reference uses CUDA's `logf`/`expf` and Triton `lg2.approx`-based `tl.log`, so a Gumbel near-tie
or a top-p mass within float rounding of its threshold may flip a rare row; the checks allow a handful of
such rows and require everything else to be identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


VOCAB = 151936  # Qwen3's
ROWS = 256


def _logits(kind: str, seed: int) -> torch.Tensor:
    """[ROWS, VOCAB]: "flat" Gaussian logits, or "peaked" ones shaped like a language model's (a few tokens
    far above a long tail)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(ROWS, VOCAB, device="cuda", generator=g) * 3
    if kind == "peaked":
        x = x * 1.5 - 4
        top = torch.randint(0, VOCAB, (ROWS, 40), device="cuda", generator=g)
        x.scatter_(1, top, torch.rand(ROWS, 40, device="cuda", generator=g) * 12 + 14)
    x[1, : VOCAB // 3] = float("-inf")
    x[2] = float("-inf")
    x[3, 77] = float("nan")
    x[4, : VOCAB // 2] = 0.0  # a huge tie
    return x


def _params(seed: int):
    from samplers.reference import SlotSamplingParams

    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = 64
    temperature = torch.rand(slots, device="cuda", generator=g) * 1.5 + 0.2
    temperature[::9] = 0.0  # greedy
    top_k = torch.randint(0, 120, (slots,), device="cuda", generator=g, dtype=torch.int32)
    top_k[::4] = 0
    top_k[5] = 1
    top_k[6] = VOCAB
    top_k[7] = 4000  # more candidates than the buffer: the exact slow path
    top_p = torch.rand(slots, device="cuda", generator=g) * 0.9 + 0.05
    top_p[::3] = 1.0
    top_p[8] = 1e-6
    top_p[10] = 0.999
    min_p = torch.where(torch.rand(slots, device="cuda", generator=g) < 0.3, 0.05, 0.0)
    seed_ = torch.randint(-(1 << 62), 1 << 62, (slots,), device="cuda", generator=g)
    return SlotSamplingParams(temperature, top_k, top_p, min_p, seed_)


@pytest.mark.parametrize("kind", ["flat", "peaked"])
def test_fused_matches_the_reference_and_the_unfused_kernels(kind):
    from samplers.fused_sampling import sample_fused_triton
    from samplers.gumbel import gumbel_sample_triton
    from samplers.reference import sample_reference
    from samplers.sanitize import sanitize_logits_triton
    from samplers.top_k_top_p import apply_min_p_triton, apply_top_k_top_p_triton

    logits = _logits(kind, 0)
    params = _params(1)
    idx = torch.randint(0, len(params.seed), (ROWS,), device="cuda", dtype=torch.int32)
    positions = torch.randint(0, 1 << 20, (ROWS,), device="cuda")
    got = sample_fused_triton(logits, idx, positions, params)
    ref = sample_reference(logits, idx, positions, params)
    assert torch.equal(got.errors, ref.errors)
    assert int((got.sampled != ref.sampled).sum()) <= 3

    # The unfused Triton stages share the fused path's log/exp, so only top-p mass rounding can differ.
    x, _ = sanitize_logits_triton(logits.clone())
    slots = idx.long()
    t = params.temperature[slots]
    greedy = t == 0
    y = x / torch.where(greedy, 1.0, t).unsqueeze(1)
    y = apply_top_k_top_p_triton(
        y, torch.where(greedy, 0, params.top_k[slots]), torch.where(greedy, 1.0, params.top_p[slots])
    )
    y = apply_min_p_triton(y, torch.where(greedy, 0.0, params.min_p[slots]))
    unfused = torch.where(greedy, x.argmax(-1), gumbel_sample_triton(y, params.seed[slots], positions))
    assert int((got.sampled != unfused).sum()) <= 2
    # The sampled tokens are ones the unfused stages kept (but for a top-p rounding flip).
    kept = torch.isfinite(y.gather(1, got.sampled.unsqueeze(1))).squeeze(1)
    assert int((~kept & (ref.errors == 0)).sum()) <= 2


@pytest.mark.parametrize("kind", ["flat", "peaked"])
def test_all_gather_rows_match_the_reference(kind):
    """Every row random with top-k or top-p (the sample kernel not launched): the reference's tokens."""
    from samplers.fused_sampling import sample_fused_triton
    from samplers.reference import sample_reference

    logits = _logits(kind, 1)
    params = _params(2)
    gather = (
        ((params.temperature > 0) & (((params.top_k > 0) & (params.top_k < logits.shape[1])) | (params.top_p < 1)))
        .nonzero()
        .flatten()
    )
    idx = gather[torch.randint(0, len(gather), (ROWS,), device="cuda")].int()
    positions = torch.randint(0, 1 << 20, (ROWS,), device="cuda")
    got = sample_fused_triton(logits, idx, positions, params, all_gather=True)
    ref = sample_reference(logits, idx, positions, params)
    assert torch.equal(got.errors, ref.errors)
    assert int((got.sampled != ref.sampled).sum()) <= 3


# Launch shapes of the plan (module constants of samplers.fused_sampling) other than the default.
PLAN_CONFIGS = {
    "g32 nreg64": dict(GROUP=32, CAP=2048, PLAN_MAXNREG=64),
    "g16 resolve w8 tile32": dict(GROUP=16, CAP=1024, RESOLVE_WARPS=8, RESOLVE_TILE=32),
    "w16 r4 s4 p2048 tile64": dict(
        PLAN_WARPS=16, PLAN_MAXNREG=None, RESOLVE_WARPS=4, STATS_WARPS=4, TARGET_PROGRAMS=2048, RESOLVE_TILE=64
    ),
    "g64": dict(GROUP=64, CAP=4096),
}


@pytest.mark.parametrize("plan", sorted(PLAN_CONFIGS))
def test_plan_configurations_sample_the_default_tokens(monkeypatch, plan):
    """Every plan configuration gathers a covering candidate set and resolves it exactly: the same tokens as
    the default configuration (a row the exact slow path takes in one and not the other may flip at a top-p
    rounding: at most 2)."""
    import samplers.fused_sampling as fused

    params = _params(1)
    idx = torch.randint(0, len(params.seed), (ROWS,), device="cuda", dtype=torch.int32)
    positions = torch.randint(0, 1 << 20, (ROWS,), device="cuda")
    for kind in ("flat", "peaked"):
        logits = _logits(kind, 0)
        default = fused.sample_fused_triton(logits, idx, positions, params)
        with monkeypatch.context() as patch:
            for name, value in PLAN_CONFIGS[plan].items():
                patch.setattr(fused, name, value)
            got = fused.sample_fused_triton(logits, idx, positions, params)
        assert torch.equal(got.errors, default.errors)
        assert int((got.sampled != default.sampled).sum()) <= 2


def test_fused_sampler_does_not_sync_and_is_deterministic():
    from helpers.sampler_cases import Slot, make_sampler

    from framework import SamplingParams

    slots = [
        Slot(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i), prompt=[1, 2], seed=i) for i in range(8)
    ]
    slots += [
        Slot(SamplingParams(temperature=1.0, top_p=0.95, min_p=0.02, seed=9), prompt=[3], seed=9),
        Slot(SamplingParams(temperature=0.0), prompt=[4]),
    ]
    sampler, _ = make_sampler(slots, VOCAB, device="cuda")
    logits = _logits("peaked", 3)
    idx = (torch.arange(ROWS, device="cuda") % len(slots)).int()
    positions = torch.arange(ROWS, device="cuda") + 5
    stages = sampler.states.stages_for(np.arange(len(slots)))
    first = sampler(logits.clone(), idx, positions, stages)  # compiles outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = sampler(logits.clone(), idx, positions, stages)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first.sampled_token_ids, again.sampled_token_ids)
    assert torch.equal(first.errors, again.errors)


def test_chi_square_through_the_fused_path():
    """The CPU suite's chi-square configurations, 120,000 draws each, sampled by the fused path."""
    from test_sampler_distributions import CONFIGS, assert_chi_square, draw_counts

    counts = draw_counts(device="cuda")
    for name in CONFIGS:
        assert_chi_square(name, counts[name])


def test_penalties_before_the_fused_passes_equal_the_reference():
    """The Sampler penalises the listed tokens in place (the list-walking kernel), then samples with the fused
    passes: the logits it leaves are the reference's penalised logits, and the tokens are sampled from them."""
    from helpers.sampler_cases import Slot, make_sampler

    from framework import SamplingParams
    from samplers.fused_sampling import sample_fused_triton
    from samplers.penalties import apply_penalties_reference
    from samplers.reference import SlotSamplingParams

    slots = [
        Slot(
            SamplingParams(
                temperature=0.8,
                top_k=50,
                top_p=0.9,
                repetition_penalty=1.2,
                frequency_penalty=0.3,
                presence_penalty=0.2,
                seed=i,
            ),
            prompt=list(range(7 * i, 7 * i + 40)),
            output=[5, 5, 9],
            seed=i,
        )
        for i in range(6)
    ]
    slots += [Slot(SamplingParams(temperature=1.0, top_p=0.95, seed=9), prompt=[3], seed=9)]  # no penalties
    sampler, _ = make_sampler(slots, VOCAB, device="cuda")
    logits = _logits("peaked", 5)
    logits[:, :300] += 10.0  # the seen tokens matter
    idx = (torch.arange(ROWS, device="cuda") % len(slots)).int()
    positions = torch.arange(ROWS, device="cuda") + 50
    stages = sampler.states.stages_for(np.arange(len(slots)))
    fused_logits = logits.clone()
    got = sampler(fused_logits, idx, positions, stages)
    pen = sampler.states.penalties
    want = apply_penalties_reference(
        logits, idx, pen.repetition, pen.frequency, pen.presence, pen.counts.output_counts, pen.counts.prompt_mask
    )
    torch.testing.assert_close(fused_logits.nan_to_num(), want.nan_to_num())
    assert not torch.equal(want.nan_to_num(), logits.nan_to_num())
    t = sampler.states.params.tensors
    params = SlotSamplingParams(t["temperature"], t["top_k"], t["top_p"], t["min_p"], t["seed"])
    ref = sample_fused_triton(fused_logits.clone(), idx, positions, params, nonfinite_code=1, no_token_code=2)
    assert torch.equal(got.sampled_token_ids, ref.sampled)
    assert torch.equal(got.errors, ref.errors)
    # Against the reference's penalised logits: an ulp of x / repetition may flip a rare near tie.
    on_reference = sample_fused_triton(want, idx, positions, params, nonfinite_code=1, no_token_code=2)
    assert int((on_reference.sampled != got.sampled_token_ids).sum()) <= 2


@pytest.mark.parametrize("kind", ["flat", "peaked"])
def test_bf16_logits_sample_the_tokens_of_their_float32_copy(kind):
    """The LM head's bf16 logits at 256 x 151,936, read by the fused kernels as they are (widened in registers):
    bit for bit the tokens and errors of their `.float()` copy (the same kernels on the same values: no
    tolerance), on every path (default, every row gathering, no plan). Through the Sampler, plain rows (which get
    the bf16 logits) and rows with logprobs (a float32 copy): the same tokens, errors and logprobs."""
    from helpers.sampler_cases import Slot, make_sampler

    from framework import SamplingParams
    from samplers.fused_sampling import sample_fused_triton

    logits = _logits(kind, 4).bfloat16()
    params = _params(5)
    g = torch.Generator(device="cuda").manual_seed(6)
    positions = torch.randint(0, 1 << 20, (ROWS,), device="cuda", generator=g)
    t, k, p, m = params.temperature, params.top_k, params.top_p, params.min_p
    gather = ((t > 0) & (((k > 0) & (k < VOCAB)) | (p < 1))).nonzero().flatten()
    direct = ((t == 0) | (((k <= 0) | (k >= VOCAB)) & (p >= 1) & (m == 0))).nonzero().flatten()

    def rows_of(slots: torch.Tensor) -> torch.Tensor:
        return slots[torch.randint(0, len(slots), (ROWS,), device="cuda", generator=g)].int()

    cases = [
        (rows_of(torch.arange(len(params.seed), device="cuda")), {}),
        (rows_of(gather), dict(all_gather=True)),
        (rows_of(direct), dict(need_plan=False)),
    ]
    for idx, kwargs in cases:
        got = sample_fused_triton(logits, idx, positions, params, **kwargs)
        want = sample_fused_triton(logits.float(), idx, positions, params, **kwargs)
        assert torch.equal(got.sampled, want.sampled), kwargs
        assert torch.equal(got.errors, want.errors), kwargs

    mixes = [
        dict(temperature=0.0),
        dict(temperature=0.8),
        dict(temperature=1.0, top_k=50),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.2, min_p=0.05),
        dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02),
    ]
    idx = (torch.arange(ROWS, device="cuda") % len(mixes)).int()
    for logprobs in (None, 5):
        slots = [
            Slot(SamplingParams(**mix, seed=i, logprobs=logprobs), prompt=[1, 2], seed=i) for i, mix in enumerate(mixes)
        ]
        sampler, _ = make_sampler(slots, VOCAB, device="cuda")
        stages = sampler.states.stages_for(np.arange(len(slots)))
        got = sampler(logits.clone(), idx, positions, stages)
        want = sampler(logits.float(), idx, positions, stages)
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
        assert torch.equal(got.errors, want.errors)
        assert (got.logprobs is None) == (want.logprobs is None) == (logprobs is None)
        if logprobs is not None:
            assert all(torch.equal(a, b) for a, b in zip(got.logprobs, want.logprobs))
