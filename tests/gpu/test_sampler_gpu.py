"""Sampler kernels at real shapes on a GPU (skipped without CUDA), and the engine sampling on the device.

Run on the GPU machine: `python -m pytest -q tests/gpu/test_sampler_gpu.py`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 151936  # Qwen3's


def _logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, VOCAB, device="cuda", generator=g) * 3
    x[1, : VOCAB // 3] = float("-inf")
    return x


def test_gumbel_and_top_k_top_p_min_p_at_real_shapes():
    from samplers.gumbel import gumbel_sample_reference, gumbel_sample_triton
    from samplers.top_k_top_p import (
        apply_min_p_reference,
        apply_min_p_triton,
        apply_top_k_top_p_reference,
        apply_top_k_top_p_triton,
    )

    rows = 64
    logits = _logits(rows, 0)
    seeds = torch.randint(-(1 << 62), 1 << 62, (rows,), device="cuda")
    positions = torch.randint(0, 1 << 20, (rows,), device="cuda")
    same = gumbel_sample_triton(logits, seeds, positions) == gumbel_sample_reference(logits, seeds, positions)
    assert int(same.sum()) >= rows - 1  # a last-ulp difference of log() may flip a near tie, nothing more
    top_k = torch.randint(0, 200, (rows,), device="cuda", dtype=torch.int32)
    top_p = torch.rand(rows, device="cuda") * 0.9 + 0.05
    top_p[::3] = 1.0
    ref = apply_top_k_top_p_reference(logits, top_k, top_p)
    got = apply_top_k_top_p_triton(logits.clone(), top_k, top_p)
    kept_ref, kept_got = torch.isfinite(ref).sum(1), torch.isfinite(got).sum(1)
    assert (kept_ref - kept_got).abs().max() <= 1  # masses may round differently right at the threshold
    assert (kept_ref == kept_got).float().mean() > 0.95
    min_p = torch.rand(rows, device="cuda") * 0.5
    assert torch.equal(
        torch.isfinite(apply_min_p_triton(logits.clone(), min_p)), torch.isfinite(apply_min_p_reference(logits, min_p))
    )


def test_seen_lists_at_real_shapes():
    """The count kernels keep the seen-token lists with GPU atomics (many lanes racing on one word, repeats
    within a block): the same sets as the references, each token once."""
    from samplers.penalty_counts import (
        PenaltyCounts,
        init_token_counts_reference,
        init_token_counts_triton,
        update_token_counts_reference,
        update_token_counts_triton,
    )

    g = torch.Generator(device="cuda").manual_seed(3)
    slots, max_len, k = 64, 2048, 3
    # Zipf-like ids (many repeats, many tokens within one 32-bit word) and a few uniform ones.
    zipf = torch.from_numpy(np.random.default_rng(0).zipf(1.2, (slots, max_len)) % 3000).int().cuda()
    all_ids = torch.where(
        torch.rand(slots, max_len, device="cuda", generator=g) < 0.1,
        torch.randint(0, VOCAB, (slots, max_len), device="cuda", generator=g, dtype=torch.int32),
        zipf,
    )
    prompt_len = torch.randint(1, 1500, (slots,), device="cuda", generator=g, dtype=torch.int32)
    prefill_len = (prompt_len + torch.randint(0, 400, (slots,), device="cuda", generator=g)).int()
    steps = []
    for step in range(4):
        sampled = all_ids[:, step * 4 : step * 4 + k + 1].long()  # already seen tokens, and repeats
        sampled[::2, -1] = torch.randint(0, VOCAB, (slots // 2,), device="cuda", generator=g)  # new ones
        steps.append(
            (
                torch.randperm(slots, device="cuda", generator=g).int(),
                sampled,
                torch.randint(0, k + 2, (slots,), device="cuda", generator=g, dtype=torch.int32),
            )
        )
    runs = []
    for init, update in (
        (init_token_counts_reference, update_token_counts_reference),
        (init_token_counts_triton, update_token_counts_triton),
    ):
        counts = PenaltyCounts.zeros(slots, VOCAB, max_len + k + 1, torch.device("cuda"))
        init(all_ids, prompt_len, prefill_len, torch.arange(slots, device="cuda"), counts)
        for idx_mapping, sampled, num_sampled in steps:
            update(idx_mapping, sampled, num_sampled, counts)
        runs.append(counts)
    want, got = runs
    for name in ("output_counts", "prompt_mask", "seen_bits", "num_seen"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    width = int(want.num_seen.max())
    valid = torch.arange(width, device="cuda") < want.num_seen.unsqueeze(1)
    big = torch.iinfo(torch.int32).max
    assert torch.equal(
        torch.where(valid, got.seen_ids[:, :width], big).sort(1).values,
        torch.where(valid, want.seen_ids[:, :width], big).sort(1).values,
    )


def test_penalties_logprobs_and_masks_at_real_shapes():
    from samplers.logprobs import logprobs_stats_reference, logprobs_stats_triton
    from samplers.penalties import PenaltyTables, apply_penalties_reference, apply_penalties_triton
    from samplers.penalty_counts import PenaltyCounts, seen_bits_reference, seen_list_reference
    from samplers.sanitize import sanitize_logits_reference, sanitize_logits_triton

    rows, slots = 48, 64
    logits = _logits(rows, 1)
    idx = torch.randint(0, slots, (rows,), device="cuda", dtype=torch.int32)
    counts = torch.randint(0, 3, (slots, VOCAB), device="cuda", dtype=torch.int32) * (
        torch.rand(slots, VOCAB, device="cuda") < 0.01
    )
    prompt = torch.rand(slots, VOCAB, device="cuda") < 0.01
    rep, freq, pres = (
        torch.rand(slots, device="cuda") + 0.5,
        torch.rand(slots, device="cuda"),
        torch.rand(slots, device="cuda") - 0.5,
    )
    counts = counts.int()
    args = (idx, rep, freq, pres, counts, prompt)
    tables = PenaltyTables(
        rep,
        freq,
        pres,
        PenaltyCounts(counts, prompt, seen_bits_reference(prompt, counts), *seen_list_reference(prompt, counts, 8192)),
        None,
    )
    torch.testing.assert_close(
        apply_penalties_triton(logits.clone(), idx, tables), apply_penalties_reference(logits, *args)
    )
    tokens = torch.randint(0, VOCAB, (rows,), device="cuda")
    lse_r, chosen_r, rank_r = logprobs_stats_reference(logits, tokens)
    lse_t, chosen_t, rank_t = logprobs_stats_triton(logits, tokens)
    torch.testing.assert_close(lse_t, lse_r)
    assert torch.equal(rank_t, rank_r)
    bad = logits.clone()
    bad[5, 7] = float("nan")
    out_r, flag_r = sanitize_logits_reference(bad.clone())
    out_t, flag_t = sanitize_logits_triton(bad.clone())
    assert torch.equal(out_r, out_t) and torch.equal(flag_r, flag_t)


def test_engine_samples_with_every_parameter_on_the_gpu():
    """Same requests on the CPU (references) and the GPU (Triton), float32: greedy tokens and logprobs agree."""
    from framework import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            repetition_penalty=1.5,
            frequency_penalty=0.5,
            presence_penalty=0.5,
            logprobs=3,
            prompt_logprobs=2,
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            logit_bias={65: 3.0, 66: 2.0},
            bad_words=[[65, 66]],
            min_tokens=4,
            stop_token_ids=[67],
        ),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, allowed_token_ids=list(range(60, 120))),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["e"]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM("random_tiny", device=device, dtype="float32", num_kv_blocks=256)
        outs[device] = llm.generate(prompts, params, use_tqdm=False)
        del llm
    # Every greedy request compared before failing: which ones differ tells a model difference (all of them,
    # once the echo of the last prompt token stops dominating) from a sampler stage (the requests using it).
    differ = {
        i: (cpu.token_ids, gpu.token_ids)
        for i, (cpu, gpu) in enumerate(zip(outs["cpu"], outs["cuda"]))
        if params[i].temperature == 0 and cpu.token_ids != gpu.token_ids
    }
    assert not differ, differ
    for cpu, gpu in zip(outs["cpu"], outs["cuda"]):
        assert cpu.finish_reason == gpu.finish_reason
    for a, b in zip(outs["cpu"][0].logprobs, outs["cuda"][0].logprobs):
        for token in a:
            assert abs(a[token].logprob - b[token].logprob) < 1e-3
    for a, b in zip(outs["cpu"][0].prompt_logprobs[1:], outs["cuda"][0].prompt_logprobs[1:]):
        assert set(a) == set(b)
    assert all(60 <= t < 120 for t in outs["cuda"][2].token_ids)
