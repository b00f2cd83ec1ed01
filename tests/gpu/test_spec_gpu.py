"""Speculative decoding on the GPU (skipped without CUDA): kernels vs references at real shapes, a decode step
with drafts that never syncs with the host, graph replay with drafts equal to eager, greedy equality.

Run on the GPU machine: `python -m pytest -q tests/gpu/test_spec_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
from helpers.sync_check import step_without_host_sync

from speculators.policy import FixedK

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SEGMENT = [11, 200, 37, 5, 90, 141, 66, 17, 3]


def _repetitive_prompts(n: int) -> list[list[int]]:
    return [(SEGMENT[i % 5 :] + SEGMENT) * (2 + i % 3) for i in range(n)]


def test_rejection_kernels_at_real_shapes():
    from speculators.rejection_sampler import (
        combine_reference,
        combine_triton,
        draft_columns,
        verify_probs_reference,
        verify_probs_triton,
    )

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, slots, k, vocab = 256, 512, 5, 151936
    idx = torch.randperm(slots, device="cuda", generator=g)[:rows].int()
    num_draft = torch.randint(0, k + 1, (rows,), device="cuda", generator=g)
    cu = torch.zeros(rows + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.cumsum(num_draft + 1, 0)
    num_logits = int(cu[-1])
    drafts = torch.randint(0, 4, (slots, k), device="cuda", generator=g, dtype=torch.int32)
    cand = torch.randint(0, 4, (num_logits,), device="cuda", generator=g)
    acc = torch.rand(num_logits, device="cuda", generator=g) < 0.7
    for accepted in (None, acc):
        want = combine_reference(idx, cu, drafts, cand, accepted, k)
        got = combine_triton(idx, cu, drafts, cand, accepted, k)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
    # Probabilistic verification over a real vocabulary (a few rows: the reference materialises [L, V] hashes).
    few = 24
    logits = torch.randn(few, vocab, device="cuda", generator=g) * 3
    q = torch.softmax(torch.randn(8, k, vocab, device="cuda", generator=g), -1)
    exp = torch.arange(8, device="cuda", dtype=torch.int32).repeat_interleave(3)
    cu_small = torch.arange(9, device="cuda", dtype=torch.int32) * 3
    cols = draft_columns(cu_small, few)
    sampled = torch.randint(0, vocab, (few,), device="cuda", generator=g)
    args = (
        logits,
        sampled,
        drafts[:8] * 1000,
        q,
        exp,
        cols,
        torch.ones(few, dtype=torch.bool, device="cuda"),
        torch.full((few,), 5, device="cuda"),
        torch.arange(few, device="cuda") + 100,
    )
    want_acc, want_cand = verify_probs_reference(*args)
    got_acc, got_cand = verify_probs_triton(*args)
    assert torch.equal(got_acc, want_acc)
    # The residual argmax may differ on float ties between exp/log implementations: allow a rare mismatch.
    assert (got_cand != want_cand).sum() <= 1


def test_penalty_kernel_counts_drafts_at_real_shapes():
    """Verification rows count the drafts before them: the list-walking Triton kernel against the reference."""
    from samplers.penalties import DraftContext, PenaltyTables, apply_penalties_reference, apply_penalties_triton
    from samplers.penalty_counts import PenaltyCounts, seen_bits_reference, seen_list_reference

    g = torch.Generator(device="cuda").manual_seed(2)
    rows, slots, k, vocab = 128, 256, 5, 151936
    idx = torch.randperm(slots, device="cuda", generator=g)[:rows].int()
    num_draft = torch.randint(0, k + 1, (rows,), device="cuda", generator=g)
    expanded = idx.repeat_interleave(num_draft + 1)
    total_len = torch.randint(10, 1000, (slots,), device="cuda", generator=g, dtype=torch.int32)
    cu = torch.cumsum(num_draft + 1, 0) - (num_draft + 1)
    offset = torch.arange(len(expanded), device="cuda") - cu.repeat_interleave(num_draft + 1)
    positions = total_len.long()[expanded.long()] + offset
    drafts = torch.randint(0, vocab, (slots, k), device="cuda", generator=g, dtype=torch.int32)
    drafts[:, 2] = drafts[:, 0]  # repeated tokens among the drafts
    counts = (
        torch.randint(0, 3, (slots, vocab), device="cuda", generator=g, dtype=torch.int32)
        * (torch.rand(slots, vocab, device="cuda", generator=g) < 0.002)
    ).int()
    prompt = torch.rand(slots, vocab, device="cuda", generator=g) < 0.002
    rep, freq, pres = (
        torch.rand(slots, device="cuda") + 0.5,
        torch.rand(slots, device="cuda"),
        torch.rand(slots, device="cuda") - 0.5,
    )
    logits = torch.randn(len(expanded), vocab, device="cuda", generator=g) * 3
    context = DraftContext(positions, total_len, drafts)
    args = (expanded, rep, freq, pres, counts, prompt)
    want = apply_penalties_reference(logits, *args, context)
    tables = PenaltyTables(
        rep,
        freq,
        pres,
        PenaltyCounts(counts, prompt, seen_bits_reference(prompt, counts), *seen_list_reference(prompt, counts, 2048)),
        context,
    )
    torch.testing.assert_close(apply_penalties_triton(logits.clone(), expanded, tables), want)
    assert not torch.equal(want, apply_penalties_reference(logits, *args))  # the drafts changed something


def test_ngram_kernel_reads_pinned_host_history():
    from speculators.ngram import ngram_propose_reference, ngram_propose_triton

    g = torch.Generator().manual_seed(1)
    slots, width, rows = 300, 4096, 256
    history = torch.randint(0, 20, (slots, width), generator=g, dtype=torch.int32)
    total = torch.randint(1, width + 1, (slots,), generator=g, dtype=torch.int32)
    idx = torch.randperm(slots, generator=g)[:rows].int()
    want = ngram_propose_reference(idx, history, total, 5, 2, 5)
    got = ngram_propose_triton(idx.cuda(), history.pin_memory(), total.cuda(), 5, 2, 5)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
def test_decode_step_with_drafts_has_no_host_sync(penalties):
    from framework import LLM, SamplingParams

    llm = LLM(
        "tiny",
        device="cuda",
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        async_scheduling=False,
        speculative_config=NGRAM,
    )
    engine = llm.engine
    for i, prompt in enumerate(_repetitive_prompts(8)):
        extra = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1) if penalties and i % 4 else {}
        params = SamplingParams(
            temperature=0.8 if i % 2 else 0.0, top_p=0.9, top_k=20, max_tokens=32, ignore_eos=True, **extra
        )
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # prefill; warm-up: compilation and first allocations may sync
    engine.step()  # first verification step (compiles the rejection kernels)
    verified = 0
    for _ in range(5):
        so = engine.scheduler.schedule()
        verified += sum(so.num_draft_tokens)
        step_without_host_sync(engine, so)
    assert verified > 0
    for k in (0, 1):  # fewer drafts than K: the [R, k+1] output must still land without a wait
        engine.draft_policy = engine.scheduler.draft_policy = FixedK(k)
        for _ in range(2):  # first steps at this k: kernel variants may compile and load
            engine.step()
        step_without_host_sync(engine)


@pytest.mark.parametrize("method", ["ngram", "dynamic"])
def test_cuda_graph_replay_with_drafts_equals_eager(method):
    from framework import LLM, SamplingParams

    spec = {**NGRAM, "dynamic_k": True} if method == "dynamic" else NGRAM
    prompts = _repetitive_prompts(11)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True)
    outs, replays = {}, []
    for graphs in (False, True):
        llm = LLM(
            "tiny",
            device="cuda",
            dtype="float32",
            gpu_memory_utilization=0.3,
            cuda_graphs=graphs,
            speculative_config=spec,
        )
        if graphs:
            run = llm.engine.runner.graphs.cuda_graphs.run
            llm.engine.runner.graphs.cuda_graphs.run = lambda size, ids, pos, meta, **kw: (  # type: ignore[method-assign]
                replays.append(meta.num_tokens // meta.num_rows),
                run(size, ids, pos, meta, **kw),
            )[1]
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outs[True] == outs[False]
    assert any(q > 1 for q in replays), "no graph replay verified drafts"


@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
def test_greedy_ngram_equals_no_speculation_on_gpu(tmp_path, penalties):
    from helpers.hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint

    from framework import LLM, SamplingParams

    save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], tmp_path)
    prompts = random_prompts(6, 5, 60, seed=3) + _repetitive_prompts(4)
    extra = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2) if penalties else {}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **extra)
    outs = {}
    for spec in (None, NGRAM):
        kwargs = {"speculative_config": spec} if spec else {}
        llm = LLM(
            str(tmp_path), device="cuda", dtype="float32", max_model_len=128, gpu_memory_utilization=0.3, **kwargs
        )
        outs[spec is None] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outs[True] == outs[False]
