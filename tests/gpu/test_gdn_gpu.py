"""Gated DeltaNet hybrids on a GPU (skipped without CUDA): kernels at Qwen3.5 shapes, HF parity, graphs = eager.

Run on the GPU machine: `python -m pytest -q tests/gpu/test_gdn_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_delta_rule_and_gated_norm_kernels_at_real_shapes() -> None:
    from framework.layers.kernels.gated_delta_rule import (
        DeltaRuleInputs,
        gated_delta_rule_varlen_chunked,
        gated_delta_rule_varlen_triton,
    )
    from framework.layers.kernels.gated_rms_norm import gated_rms_norm_reference, gated_rms_norm_triton
    from framework.layers.kernels.state_snapshots import build_snapshot_targets

    hk, h, dk, dv = 16, 32, 128, 128  # Qwen3.5's linear-attention heads
    lens = [300, 1, 1, 77, 4, 129]
    t, rows, dev = sum(lens), len(lens), "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    inp = DeltaRuleInputs(
        q=r(t, hk, dk).bfloat16(),
        k=r(t, hk, dk).bfloat16(),
        v=r(t, h, dv).bfloat16(),
        g=-torch.rand(t, h, device=dev, generator=g) * 0.3,
        beta=torch.rand(t, h, device=dev, generator=g),
    )
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    idx = torch.tensor([5, 0, 9, 3, 7, 1], dtype=torch.int32, device=dev)
    snaps = build_snapshot_targets([0, 0, 5], [64, 128, 64], [0, 1, 2], rows, torch.device(dev))
    s0 = r(12, h, dk, dv) * 0.1
    res = []
    for fn in (gated_delta_rule_varlen_chunked, gated_delta_rule_varlen_triton):
        state, tail, pool = (
            s0.clone(),
            torch.zeros(rows, 3, h, dk, dv, device=dev),
            torch.zeros(3, h, dk, dv, device=dev),
        )
        out = fn(inp, state, idx, qsl, tail, snaps, pool)
        res.append((out.float(), state, tail, pool))
    for got, want in zip(res[1], res[0]):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    x, z, w = r(t * h, dv).bfloat16(), r(t * h, dv).bfloat16(), r(dv).bfloat16()
    torch.testing.assert_close(
        gated_rms_norm_triton(x, z, w, 1e-6), gated_rms_norm_reference(x, z, w, 1e-6), atol=3e-2, rtol=2e-2
    )


def test_qwen3_5_matches_hf_and_graphs_equal_eager(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A tiny random Qwen3.5 on the GPU: greedy tokens equal HF's (float32); with CUDA graphs equal without."""
    from helpers.gdn_models import QWEN3_5, slow_decay_checkpoint
    from helpers.hf_models import hf_greedy, random_prompts

    from framework.entrypoints.llm import LLM
    from framework.params.sampling_params import SamplingParams

    model = slow_decay_checkpoint(QWEN3_5, tmp_path)
    prompts = random_prompts(4, 6, 40, seed=9)
    want = [hf_greedy(model, p, 16) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(
            str(tmp_path),
            device="cuda",
            dtype="float32",
            max_model_len=128,
            cuda_graphs=graphs,
            max_num_batched_tokens=13,
            gpu_memory_utilization=0.3,
        )
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outs[False] == want
    assert outs[True] == want


@pytest.mark.parametrize("lens", [[8192], [3000, 1, 0, 64, 700, 129]], ids=["one_8k_row", "mixed_rows"])
def test_chunk_kernel_at_real_shapes(lens: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked prefill kernel against the recurrent one (float32 inputs: both exact to rounding) and in bf16
    against the float32 result, at Qwen3.5's linear-attention shapes (16 key heads, 32 value heads, 128 x 128);
    with tails and snapshots on the mixed rows; the dispatch sends these steps to the chunked kernel."""
    from framework.layers.kernels import gated_delta_rule as gdr
    from framework.layers.kernels.gated_delta_rule_chunk import chunk_gated_delta_rule_varlen_triton
    from framework.layers.kernels.state_snapshots import build_snapshot_targets

    hk, h, dk, dv, dev = 16, 32, 128, 128, "cuda"
    t, rows = sum(lens), len(lens)
    g = torch.Generator(device=dev).manual_seed(1)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    inp = gdr.DeltaRuleInputs(
        q=r(t, hk, dk),
        k=r(t, hk, dk),
        v=r(t, h, dv),
        g=-torch.rand(t, h, device=dev, generator=g) * 0.2,
        beta=torch.rand(t, h, device=dev, generator=g),
    )
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    idx = torch.randperm(16, device=dev, generator=g)[:rows].int()
    snaps = build_snapshot_targets([0, 0, 0], [0, 128, 1024], [0, 1, 2], rows, torch.device(dev))
    s0 = r(16, h, dk, dv) * 0.1

    def run(fn, x):  # type: ignore[no-untyped-def]
        state, tail, pool = (
            s0.clone(),
            torch.zeros(rows, 2, h, dk, dv, device=dev),
            torch.zeros(3, h, dk, dv, device=dev),
        )
        return fn(x, state, idx, qsl, tail, snaps, pool).float(), state, tail, pool

    chunk = lambda x, *a: chunk_gated_delta_rule_varlen_triton(*x, *a)  # noqa: E731
    want = run(gdr.gated_delta_rule_varlen_triton, inp)
    for got, ref in zip(run(chunk, inp), want):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    bf16 = gdr.DeltaRuleInputs(inp.q.bfloat16(), inp.k.bfloat16(), inp.v.bfloat16(), inp.g, inp.beta)
    for got, ref in zip(run(chunk, bf16), run(gdr.gated_delta_rule_varlen_triton, bf16)):
        torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)
    calls: list[int] = []
    real = gdr.chunk_gated_delta_rule_varlen_triton
    monkeypatch.setattr(gdr, "chunk_gated_delta_rule_varlen_triton", lambda *a: calls.append(1) or real(*a))
    run(gdr.gated_delta_rule_varlen, inp)
    assert calls, "a prefill step did not take the chunked kernel"


def _mtp_keeps_greedy_tokens(tmp_path, spec, fused: bool) -> None:  # type: ignore[no-untyped-def]
    """speculator.method=mtp (the checkpoint's mtp.* head, fitted to the target, its experts stored fused or per
    expert) on the GPU: greedy tokens equal the run without speculation, with draft CUDA graphs and without; the
    first draft is mostly accepted."""
    from helpers.gdn_models import slow_decay_checkpoint
    from helpers.hf_models import random_prompts
    from helpers.qwen_mtp import checkpoint_layout, fitted_mtp_tensors
    from safetensors.torch import save_file

    from framework.entrypoints.llm import LLM
    from framework.params.sampling_params import SamplingParams

    model = slow_decay_checkpoint(spec, tmp_path)
    prompts = random_prompts(4, 6, 40, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_model_len=128, max_num_batched_tokens=13)
    llm = LLM(str(tmp_path), gpu_memory_utilization=0.3, **common)
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    tensors = fitted_mtp_tensors(tmp_path, model, [p + t for p, t in zip(prompts, want)])
    save_file(checkpoint_layout(tensors, fused), str(tmp_path / "mtp.safetensors"))
    for graphs in (False, True):
        spec_cfg = {"method": "mtp", "num_speculative_tokens": 3, "draft_cuda_graphs": graphs}
        llm = LLM(str(tmp_path), gpu_memory_utilization=0.3, speculative_config=spec_cfg, cuda_graphs=graphs, **common)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want, graphs
        stats = llm.engine.spec_metrics
        assert stats.per_position_acceptance[0] > 0.9 and stats.num_accepted_tokens < stats.num_draft_tokens
        del llm


def test_qwen3_5_mtp_speculation_keeps_greedy_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The dense Qwen3.5 MTP head."""
    from helpers.gdn_models import QWEN3_5

    _mtp_keeps_greedy_tokens(tmp_path, QWEN3_5, fused=False)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_moe_mtp_speculation_keeps_greedy_tokens(tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    """MTP heads whose block has the sparse MoE MLP (routed experts in the fused MoE kernel, the gated shared
    expert): Qwen3-Next with per-expert tensors, Qwen3.5-MoE with fused ones."""
    from helpers.gdn_models import QWEN3_5_MOE, QWEN3_NEXT

    spec, fused = {"qwen3_next": (QWEN3_NEXT, False), "qwen3_5_moe": (QWEN3_5_MOE, True)}[name]
    _mtp_keeps_greedy_tokens(tmp_path, spec, fused)


def test_first_launch_compiles_every_variant_of_both_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """`warm_delta_rule_variants`: after a geometry's first dispatch (a plain decode step), steps with snapshots, tails
    or prefill rows, through either kernel, compile nothing new. Control: without the warm-up, a step with snapshots
    compiles in the step that first takes it."""
    from framework.entrypoints.bench.triton_compiles import compiled_variants, new_variants
    from framework.layers.kernels import gated_delta_rule as gdr
    from framework.layers.kernels.gated_delta_rule import DeltaRuleInputs, gated_delta_rule_varlen
    from framework.layers.kernels.state_snapshots import build_snapshot_targets

    monkeypatch.setattr(gdr, "_WARMED", set())
    dev = torch.device("cuda")

    def step(dk: int, lens: list[int], tails: bool = False, snaps: bool = False, decode: bool = False) -> None:
        hk, h, t, rows = 2, 4, sum(lens), len(lens)  # key widths no other test compiles (BLOCK_K 64 and 128)
        inp = DeltaRuleInputs(
            torch.randn(t, hk, dk, device=dev).bfloat16(), torch.randn(t, hk, dk, device=dev).bfloat16(),
            torch.randn(t, h, 48, device=dev).bfloat16(), -torch.rand(t, h, device=dev), torch.rand(t, h, device=dev),
        )  # fmt: skip
        state, pool = torch.zeros(rows, h, dk, 48, device=dev), torch.zeros(2, h, dk, 48, device=dev)
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        idx = torch.arange(rows, dtype=torch.int32, device=dev)
        tail = torch.zeros(rows, 2, h, dk, 48, device=dev) if tails else None
        targets = build_snapshot_targets([rows - 1], [1], [0], rows, dev) if snaps else None
        gated_delta_rule_varlen(inp, state, idx, qsl, tail, targets, pool if snaps else None, pure_decode=decode)
        torch.cuda.synchronize()

    with monkeypatch.context() as off:
        off.setattr(gdr, "warm_delta_rule_variants", lambda inp, state: None)
        step(48, [1, 1], decode=True)
        before = compiled_variants()
        step(48, [1, 3], snaps=True)
        assert new_variants(before, compiled_variants()), "the control compiled nothing: the check cannot see it"

    step(80, [1, 1], decode=True)
    before = compiled_variants()
    for lens in ([1, 3], [200, 100]):  # the recurrent kernel, then the chunked one
        for tails in (False, True):
            for snaps in (False, True):
                step(80, lens, tails, snaps)
    assert new_variants(before, compiled_variants()) == {}
