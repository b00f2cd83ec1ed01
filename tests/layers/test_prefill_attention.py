"""The prefill (large-row) attention kernel and its variants against `paged_attention_reference`, interpreted.

Small shapes on the CPU under TRITON_INTERPRET=1 (set before the kernels are imported): ragged fresh prompts,
chunks after cached prefixes, page sizes smaller and larger than a KV tile, GQA groups (tile = whole group or
one head), head_dim 64 (float32) and 128 (float16), every code variant of `PrefillVariant`, and
`paged_attention`'s routing of large rows (`prefill_kernel`, `prefill_variant`). Negative controls plant the bugs the
comparison
guards against (a row reading another row's blocks, one key too many, rows skipped) and check it fails.
tests/gpu/test_prefill_attention_gpu.py covers real shapes and bfloat16.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

_saved_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    from triton.runtime.interpreter import InterpretedFunction

    from framework.layers.attention import triton_paged_attention as tpa
    from framework.layers.attention import triton_prefill_attention as tfa
    from framework.layers.attention.paged import paged_attention_reference, store_kv_reference
finally:
    if _saved_interpret is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret

from helpers.attention_cases import make_paged_case  # noqa: E402

# A GPU test module imported the kernels first (compiled: nothing can be interpreted in this process): every
# test then reports its outcome from one run of this module in a fresh interpreter process (none skips).
COMPILED_FIRST = not isinstance(tfa._prefill_attention_kernel, InterpretedFunction)

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}
SMALL = tfa.PrefillVariant(32, 16, 4, 1)  # interpreter tiles: 16 tokens x group of 2, 16-key tiles


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _case(rows, *, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=0):
    case = make_paged_case(
        rows,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        num_pad_tokens=3,
    )
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)  # this step's K/V
    return case


def _run(case, variant, *, meta=None, skip_query_len=0):
    """Kernel output over a NaN-filled buffer (rows it must not write stay NaN) and the reference."""
    scale = 1 / math.sqrt(case.query.shape[-1])
    out = torch.full_like(case.query, float("nan"))
    tfa.prefill_attention(
        case.query, case.kv_cache, meta or case.meta, scale, out, skip_query_len=skip_query_len, variant=variant
    )
    return out, paged_attention_reference(case.query, case.kv_cache, case.meta, scale)


def _assert_matches(case, variant, **kwargs):
    out, ref = _run(case, variant, **kwargs)
    n = case.num_real_tokens
    assert out[n:].isnan().all(), "padding tokens were written"
    torch.testing.assert_close(out[:n], ref[:n], **TOL[case.query.dtype])


# (cached context_len, query_len) per batch row
ROWS = {
    "fresh_ragged": [(0, 37), (0, 5), (0, 64), (0, 1)],
    "cached_prefix": [(45, 18), (16, 16), (3, 70), (0, 33)],
    "long_prefix_short_chunk": [(130, 9), (77, 40)],
}
VARIANTS = {
    "default": SMALL,
    "k_rows_trans": dataclasses.replace(SMALL, k_trans=False),
    "q_prescale": dataclasses.replace(SMALL, q_prescale=True),
    "forward_order": dataclasses.replace(SMALL, reverse=False),
    "no_prefetch": dataclasses.replace(SMALL, prefetch_pages=False),
    "one_head_per_tile": dataclasses.replace(SMALL, heads=1, block_m=16),
    "wide_kv_tile": dataclasses.replace(SMALL, block_n=32, loop_stages=2),
    "qk_ahead": dataclasses.replace(SMALL, qk_ahead=True),
    "qk_ahead_rows_trans": dataclasses.replace(SMALL, qk_ahead=True, k_trans=False, q_prescale=True),
}


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_reference(rows, variant):
    _assert_matches(_case(ROWS[rows], block_size=4), VARIANTS[variant])


@pytest.mark.parametrize("block_size, block_n", [(1, 16), (4, 32), (16, 16), (32, 16)])
def test_pages_smaller_equal_and_larger_than_kv_tile(block_size, block_n):
    variant = dataclasses.replace(SMALL, block_n=block_n)
    _assert_matches(_case([(37, 20), (30, 25), (0, 40)], block_size=block_size), variant)
    _assert_matches(
        _case([(37, 20), (0, 40)], block_size=block_size), dataclasses.replace(variant, prefetch_pages=False)
    )
    _assert_matches(_case([(70, 20), (0, 40)], block_size=block_size), dataclasses.replace(variant, qk_ahead=True))


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, heads", [(4, 4, 0), (4, 1, 0), (4, 1, 2), (6, 2, 1), (14, 2, 0), (14, 2, 7)]
)
def test_gqa_groups(num_heads, num_kv_heads, heads):
    """MHA, a group of 4 (whole, halves), groups of 3 and 7 (not powers of two: spare tile rows unused)."""
    variant = dataclasses.replace(SMALL, heads=heads, block_m=16 if heads == 1 else 32)
    _assert_matches(_case([(13, 20), (0, 21)], num_heads=num_heads, num_kv_heads=num_kv_heads), variant)


def test_float16_head_dim_128():
    case = _case([(21, 17), (3, 30)], dtype=torch.float16, head_dim=128, num_heads=2, num_kv_heads=1)
    _assert_matches(case, SMALL)
    _assert_matches(case, dataclasses.replace(SMALL, q_prescale=True, k_trans=False))


def test_skips_rows_of_the_decode_launch():
    """Rows with query_len <= skip_query_len are left unwritten (the decode launch owns them)."""
    case = _case([(30, 1), (0, 20), (12, 3), (5, 16)])
    out, ref = _run(case, SMALL, skip_query_len=3)
    starts = case.meta.query_start_loc.tolist()
    mine = torch.zeros(case.query.shape[0], dtype=torch.bool)
    for r, (c, q) in enumerate([(30, 1), (0, 20), (12, 3), (5, 16)]):
        mine[starts[r] : starts[r + 1]] = q > 3
    assert out[~mine].isnan().all()
    torch.testing.assert_close(out[mine], ref[mine], **TOL[torch.float32])


@pytest.mark.parametrize("prefill_kernel", [False, True])
def test_large_rows_in_paged_attention(monkeypatch, prefill_kernel):
    """Mixed batch (decode rows, draft rows, chunks) through `paged_attention`: same result either way, and
    the prefill kernel runs exactly when `prefill_kernel` (the default)."""
    calls = []
    real = tpa.prefill_attention
    monkeypatch.setattr(tpa, "prefill_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    case = _case([(13, 20), (0, 1), (30, 3), (7, 1), (0, 40)])
    scale = 0.125
    kwargs = {} if prefill_kernel else {"prefill_kernel": False}  # the default, or the older launch
    out = tpa.paged_attention(case.query, case.kv_cache, case.meta, scale, **kwargs)
    ref = paged_attention_reference(case.query, case.kv_cache, case.meta, scale)
    n = case.num_real_tokens
    torch.testing.assert_close(out[:n], ref[:n], **TOL[torch.float32])
    assert len(calls) == prefill_kernel
    decode_only = _case([(13, 1), (4, 1)])
    tpa.paged_attention(decode_only.query, decode_only.kv_cache, decode_only.meta, scale, **kwargs)
    assert len(calls) == prefill_kernel  # a decode-only batch never reaches it


def test_default_variant_at_head_dim_128():
    assert not tfa.default_variant(128, on_gpu=True).k_trans  # the H200 sweep's best at head_dim 128


def test_variant_parse_reaches_the_launch_through_paged_attention(monkeypatch):
    assert tfa.PrefillVariant.parse("block_m=64,num_warps=4,reverse=0,k_trans=false") == tfa.PrefillVariant(
        64, 128, 4, 3, reverse=False, k_trans=False
    )
    with pytest.raises(ValueError, match="unknown PrefillVariant field"):
        tfa.PrefillVariant.parse("block_k=64")
    # A parsed variant given to paged_attention reaches the prefill kernel's launch.
    variant = tfa.PrefillVariant.parse("block_n=32,heads=1,block_m=16", SMALL)
    seen = []
    real = tfa._prefill_attention_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((grid, kwargs["BLOCK_N"], kwargs["HEADS"]))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(tfa, "_prefill_attention_kernel", Spy())
    case = _case([(0, 20)])
    out = tpa.paged_attention(case.query, case.kv_cache, case.meta, 0.125, prefill_variant=variant)
    assert seen and seen[0][1:] == (32, 1)
    n = case.num_real_tokens
    torch.testing.assert_close(
        out[:n], paged_attention_reference(case.query, case.kv_cache, case.meta, 0.125)[:n], **TOL[torch.float32]
    )


# ------------------------------------------------------------------------------------- negative controls


def test_negative_control_other_rows_blocks():
    """A kernel reading another row's KV blocks (block table rows swapped) fails the comparison."""
    case = _case([(40, 20), (40, 20)])
    swapped = dataclasses.replace(case.meta, block_tables=case.meta.block_tables.flip(0).contiguous())
    with pytest.raises(AssertionError):
        _assert_matches(case, SMALL, meta=swapped)


def test_negative_control_one_key_too_many():
    """An off-by-one causal mask (every query also sees the next key) fails the comparison."""
    case = _case([(10, 30)])
    longer = dataclasses.replace(case.meta, seq_lens=case.meta.seq_lens + 1, query_start_loc=case.meta.query_start_loc)
    # Same queries at positions shifted by one: each sees one more (random, stored) key than the reference.
    cache = case.kv_cache.clone()
    cache[torch.isnan(cache)] = 0.5
    case.kv_cache.copy_(cache)
    with pytest.raises(AssertionError):
        _assert_matches(case, SMALL, meta=longer)


def test_negative_control_rows_left_unwritten():
    """A launch that skips prefill rows (wrong skip threshold) leaves NaN where the reference has values."""
    case = _case([(0, 20), (5, 2)])
    with pytest.raises(AssertionError):
        _assert_matches(case, SMALL, skip_query_len=20)


# ------------------------------------------------------------- when a GPU module compiled the kernels first
_fresh_outcomes: dict[str, str] = {}


def _outcome_in_a_fresh_process(name: str) -> str:
    """'passed' or the failure of test `name` (with parameters) in one fresh interpreted run of this module."""
    import subprocess
    import sys
    import tempfile
    import xml.etree.ElementTree as ET

    if not _fresh_outcomes:
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "report.xml")
            env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
            subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, f"--junitxml={report}"],
                check=False,
                cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."),
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            for case in ET.parse(report).getroot().iter("testcase"):
                problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
                _fresh_outcomes[case.get("name", "")] = (
                    "passed" if problem is None else f"{problem.tag}: {problem.get('message', '')}"
                )
    return _fresh_outcomes.get(name, "missing from the fresh run")


def _from_a_fresh_process(test):  # type: ignore[no-untyped-def]
    import functools

    @functools.wraps(test)
    def delegated(*args, **kwargs):  # type: ignore[no-untyped-def]
        name = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].rsplit(" ", 1)[0]
        outcome = _outcome_in_a_fresh_process(name)
        assert outcome == "passed", f"{name} in a fresh interpreter process: {outcome}"

    return delegated


if COMPILED_FIRST:
    for _name, _test in list(globals().items()):
        if _name.startswith("test_") and callable(_test):
            globals()[_name] = _from_a_fresh_process(_test)
