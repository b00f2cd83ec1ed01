"""Decode attention with the q/k norm + RoPE + KV store fused in (`paged_attention(rope=...)`) against the two
launches it replaces (`qk_norm_rope_store_triton`, then `paged_attention`), on the CPU interpreter.

Decode batches of ragged contexts (and empty CUDA-graph padding rows, padding tokens without a KV slot), GQA
groups of 1 and 2, with and without the q/k norm weights, unsplit, split (the split that ends a row stores the
new key) and launched longest rows first; float32 and float16 (bfloat16 `tl.dot` is wrong under the
interpreter: tests/gpu/test_attention_gpu.py covers it). The caches must come out the same (every KV slot, the
poisoned unused memory included) and the outputs within rounding. Negative controls: a wrong k norm weight
and a missing KV slot change the result the comparison sees.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

_saved_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    from triton.runtime.interpreter import InterpretedFunction

    from framework.attention import triton_paged_attention as tpa
    from framework.attention.metadata import RopeInputs
    from framework.attention.row_order import rows_longest_first_reference
    from framework.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton
finally:
    if _saved_interpret is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret

try:
    from attention_cases import make_paged_case
    from test_attention_triton import _from_a_fresh_process, _same
except ImportError:  # imported as tests.test_rope_fused_attention
    from tests.attention_cases import make_paged_case
    from tests.test_attention_triton import _from_a_fresh_process, _same

COMPILED_FIRST = not isinstance(tpa._paged_attention_kernel, InterpretedFunction)  # a GPU module imported them
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3)}
DECODE_ROWS = [(5, 1), (40, 1), (0, 1), (17, 1), (63, 1)]


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rope_case(rows, *, num_heads, num_kv_heads, head_dim, dtype, norms=True, num_pad_tokens=0, seed=0):
    """(paged case, qkv [T, (H + 2 Hkv) D], RopeInputs): RoPE tables of each token's position, norm weights."""
    case = make_paged_case(rows, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                           dtype=dtype, num_pad_tokens=num_pad_tokens, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    t = case.query.shape[0]
    qkv = (torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    positions = torch.tensor([c for c, q in rows for _ in range(q)] + [0] * num_pad_tokens, dtype=torch.float32)
    freqs = positions[:, None] * (10000.0 ** (-torch.arange(0, head_dim, 2).float() / head_dim))[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype) if norms else None for _ in range(2)]
    rope = RopeInputs(emb.cos().to(dtype), emb.sin().to(dtype), weights[0], weights[1], 1e-6,
                         case.meta.kv_slot_mapping)
    return case, qkv, rope


def _two_launches(case, qkv, rope, num_heads, num_kv_heads, head_dim, **kwargs):
    cache = case.kv_cache.clone()
    q = qk_norm_rope_store_triton(qkv, rope.cos, rope.sin, rope.q_norm_weight, rope.k_norm_weight, rope.eps,
                                  num_heads, num_kv_heads, head_dim, cache, rope.kv_slot_mapping)
    return tpa.paged_attention(q, cache, case.meta, 1 / math.sqrt(head_dim), **kwargs), cache


def _fused(case, qkv, rope, num_heads, head_dim, **kwargs):
    cache = case.kv_cache.clone()
    raw_q = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
    return tpa.paged_attention(raw_q, cache, case.meta, 1 / math.sqrt(head_dim), rope=rope, **kwargs), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("num_heads, num_kv_heads, norms", [(4, 2, True), (2, 2, False)])
def test_fused_matches_two_launches(dtype, num_splits, num_heads, num_kv_heads, norms):
    head_dim = 32
    case, qkv, rope = _rope_case(DECODE_ROWS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 dtype=dtype, norms=norms, num_pad_tokens=3)
    expected, expected_cache = _two_launches(case, qkv, rope, num_heads, num_kv_heads, head_dim,
                                             num_splits=num_splits)
    actual, cache = _fused(case, qkv, rope, num_heads, head_dim, num_splits=num_splits)
    assert _same(cache, expected_cache)  # the same K/V at every slot; padding tokens stored nothing
    n = case.num_real_tokens
    assert not actual[:n].isnan().any()
    torch.testing.assert_close(actual[:n], expected[:n], **TOL[dtype])


def test_fused_with_row_order_and_empty_rows():
    """Padding rows (no tokens) and a longest-first launch order: the same as the two launches in batch order."""
    rows = [(10, 1), (0, 0), (33, 1), (0, 0), (2, 1)]
    case, qkv, rope = _rope_case(rows, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    expected, expected_cache = _two_launches(case, qkv, rope, 4, 2, 32, num_splits=1)
    order = rows_longest_first_reference(case.meta.seq_lens)
    actual, cache = _fused(case, qkv, rope, 4, 32, num_splits=1, row_order=order)
    assert _same(cache, expected_cache)
    torch.testing.assert_close(actual[: case.num_real_tokens], expected[: case.num_real_tokens], **TOL[torch.float32])


def test_head_dim_64_one_split_per_tile():
    """A larger head, and splits of one 16-key tile each (the merge of many splits)."""
    case, qkv, rope = _rope_case([(70, 1), (16, 1), (31, 1)], num_heads=4, num_kv_heads=2, head_dim=64,
                                 dtype=torch.float32, seed=3)
    expected, expected_cache = _two_launches(case, qkv, rope, 4, 2, 64, num_splits=5)
    actual, cache = _fused(case, qkv, rope, 4, 64, num_splits=5)
    assert _same(cache, expected_cache)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


def test_negative_controls():
    """A wrong k norm weight changes the stored keys and the outputs; a token whose KV slot is missing leaves its
    slot unwritten (NaN-poisoned) and its row's output NaN: the comparisons above would see either."""
    case, qkv, rope = _rope_case(DECODE_ROWS, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    expected, expected_cache = _two_launches(case, qkv, rope, 4, 2, 32, num_splits=1)
    wrong = rope._replace(k_norm_weight=rope.k_norm_weight * 1.5)
    actual, cache = _fused(case, qkv, wrong, 4, 32, num_splits=1)
    assert not _same(cache, expected_cache) and not torch.allclose(actual, expected)
    missing = rope._replace(kv_slot_mapping=rope.kv_slot_mapping.clone())
    missing.kv_slot_mapping[1] = -1
    actual, cache = _fused(case, qkv, missing, 4, 32, num_splits=1)
    assert not _same(cache, expected_cache) and actual[1].isnan().all() and not actual[0].isnan().any()


def test_rejects_prefill_rows_and_a_bad_query_view():
    case, qkv, rope = _rope_case([(5, 3), (4, 1)], num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    with pytest.raises(AssertionError, match="decode batches only"):
        _fused(case, qkv, rope, 4, 32)
    case, qkv, rope = _rope_case(DECODE_ROWS, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    with pytest.raises(AssertionError, match="q heads of"):
        tpa.paged_attention(qkv[:, :128].contiguous().view(-1, 4, 32), case.kv_cache.clone(), case.meta, 1.0,
                            rope=rope)


@pytest.mark.parametrize("fuse", [True, False])
def test_engine_takes_the_fused_launch_for_decode_steps(tiny_llm_factory, monkeypatch, fuse):
    """Through the model on the Triton backend: decode steps take the fused launch (`model.fuse_rope_attention`),
    prompt steps the two kernels; greedy tokens equal to the PyTorch reference backend's either way."""
    from framework import SamplingParams

    prompts = [[5, 17, 99, 3, 250, 8, 61, 42, 7, 13, 200], [77, 1, 2, 150, 33, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    settings = dict(block_size=4, max_num_batched_tokens=8, fuse_rope_attention=fuse)
    monkeypatch.setenv("MRV2_ATTENTION_BACKEND", "reference")
    expected = [o.token_ids for o in tiny_llm_factory(**settings).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("MRV2_ATTENTION_BACKEND", "triton")
    calls: list[tuple[int, bool]] = []
    kernel_entry = tpa.paged_attention

    def counted(*args, **kwargs):
        calls.append((args[2].max_query_len, kwargs.get("rope") is not None))
        return kernel_entry(*args, **kwargs)

    monkeypatch.setattr(tpa, "paged_attention", counted)
    actual = [o.token_ids for o in tiny_llm_factory(**settings).generate(prompts, params, use_tqdm=False)]
    assert actual == expected
    assert {fused for q_len, fused in calls if q_len == 1} == {fuse}  # every decode launch, or none
    assert not any(fused for q_len, fused in calls if q_len > 1)  # prompt steps: the two kernels


if COMPILED_FIRST:
    _outcomes: dict[str, str] = {}
    for _name, _test in list(globals().items()):
        if _name.startswith("test_") and callable(_test):
            globals()[_name] = _from_a_fresh_process(_test, __file__, _outcomes)
