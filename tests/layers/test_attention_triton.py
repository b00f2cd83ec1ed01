"""Triton KV store and paged attention against their PyTorch references, on the CPU interpreter.

The kernels are decorated at import, so TRITON_INTERPRET is set before they are imported (and set again
while these tests run). In a process where a GPU test module imported them first (compiled: Triton's own
`tl` library is decorated when triton is imported, so nothing can be interpreted there), every test of this
module instead reports its outcome from one run of the module in a fresh interpreter process: none skips.
bfloat16 attention is not tested here: `tl.dot` on bfloat16 returns garbage under the Triton 3.9 interpreter
(numpy has no bfloat16); tests/gpu/test_attention_gpu.py covers it on a GPU.
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

    from framework.layers.attention import launch_config as lc
    from framework.layers.attention import triton_paged_attention as tpa
    from framework.layers.attention.backend import attention_backend
    from framework.layers.attention.backend import paged_attention as dispatched_attention
    from framework.layers.attention.paged import paged_attention_reference, store_kv_reference
    from framework.layers.attention.row_order import (
        rows_longest_first,
        rows_longest_first_reference,
        rows_longest_first_triton,
    )
    from framework.layers.attention.triton_store_kv import _store_kv_kernel, store_kv
finally:
    if _saved_interpret is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret

from helpers.attention_cases import make_paged_case  # noqa: E402
from helpers.fresh_process import from_a_fresh_process  # noqa: E402

COMPILED_FIRST = not isinstance(_store_kv_kernel, InterpretedFunction)  # a GPU test module imported them


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _on_fp8_grid(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` (its dtype) holding only values `cache_dtype` represents exactly. Triton's interpreter rounds to FP8
    wrongly (a mantissa carry is dropped: 0.49 becomes 0.25), so interpreter stores are compared bit for bit on
    values that need no rounding; tests/gpu/test_attention_gpu.py compares the GPU's rounding of any value."""
    return x.to(cache_dtype).to(x.dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0)) and torch.equal(a.isnan(), b.isnan())


# ----------------------------------------------------------------------------------------------- store


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(
    "num_kv_heads, head_dim, cache_dtype, src_dtype",
    [
        (2, 64, torch.float32, torch.float32),
        (3, 64, torch.float16, torch.float32),  # head count not a power of two; cast on store
        (1, 128, torch.bfloat16, torch.bfloat16),
    ],
)
def test_store_kv_matches_reference(block_size, num_kv_heads, head_dim, cache_dtype, src_dtype):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens = 20, 13
    kv_slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]  # any order
    kv_slots[[2, 9]] = -1  # padding tokens
    kv_slots = torch.cat([kv_slots, torch.tensor([-1, -1])])  # CUDA-graph padding at the end
    key = torch.randn(num_tokens + 2, num_kv_heads, head_dim, generator=g).to(src_dtype)
    value = torch.randn(num_tokens + 2, num_kv_heads, head_dim, generator=g).to(src_dtype)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    expected = torch.full(shape, float("nan"), dtype=cache_dtype)
    store_kv_reference(key, value, expected, kv_slots)
    actual = torch.full(shape, float("nan"), dtype=cache_dtype)
    store_kv(key, value, actual, kv_slots)
    assert _same(actual.float(), expected.float())
    assert actual.isnan().any()  # padding and unused slots were left alone


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_fp8_saturates_like_the_reference(cache_dtype, src_dtype):
    """An FP8 cache gets the reference's bytes, values past the format's range stored as its largest one."""
    g = torch.Generator().manual_seed(7)
    limit = torch.finfo(cache_dtype).max
    key = _on_fp8_grid(torch.randn(9, 2, 64, generator=g) * 3, cache_dtype).to(src_dtype)
    value = _on_fp8_grid(torch.randn(9, 2, 64, generator=g) * 3, cache_dtype).to(src_dtype)
    key[0, 0, :4] = torch.tensor([2 * limit, -2 * limit, limit, -3.0]).to(src_dtype)  # saturated, kept, kept
    kv_slots = torch.tensor([4, 0, 7, -1, 9, 1, 2, 3, 5])
    expected = torch.zeros(2, 3, 4, 2, 64, dtype=cache_dtype)
    actual = torch.zeros(2, 3, 4, 2, 64, dtype=cache_dtype)
    store_kv_reference(key, value, expected, kv_slots)
    store_kv(key, value, actual, kv_slots)
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
    stored = actual[0].view(-1, 2, 64)[4, 0, :4].float()
    assert stored.tolist() == [limit, -limit, limit, -3.0]
    assert torch.isfinite(actual.float()).all()


def test_store_kv_reads_strided_key_value():
    """K and V as column slices of one fused QKV projection output, as a model may hand them over."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 4 * 64, generator=g)
    key = qkv[:, 128:192].view(6, 1, 64)
    value = qkv[:, 192:].view(6, 1, 64)
    kv_slots = torch.tensor([5, 0, 3, -1, 9, 1])
    expected = torch.zeros(2, 3, 4, 1, 64)
    actual = torch.zeros(2, 3, 4, 1, 64)
    store_kv_reference(key, value, expected, kv_slots)
    store_kv(key, value, actual, kv_slots)
    assert torch.equal(actual, expected)


# ------------------------------------------------------------------------------------------- attention

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _check_attention(
    rows,
    *,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    dtype=torch.float32,
    num_pad_tokens=0,
    seed=0,
    cache_dtype=None,
    **kernel_kwargs,
):
    case = make_paged_case(
        rows,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        num_pad_tokens=num_pad_tokens,
        seed=seed,
        cache_dtype=cache_dtype,
    )
    if cache_dtype is not None:
        case.key, case.value = _on_fp8_grid(case.key, cache_dtype), _on_fp8_grid(case.value, cache_dtype)
    # This step's K/V go in first, as in the model: the Triton store must leave what the reference leaves.
    triton_cache = case.kv_cache.clone()
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    store_kv(case.key, case.value, triton_cache, case.meta.kv_slot_mapping)
    assert _same(triton_cache.float(), case.kv_cache.float())
    scale = 1 / math.sqrt(head_dim)
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, scale)
    actual = tpa.paged_attention(case.query, case.kv_cache, case.meta, scale, **kernel_kwargs)
    n = case.num_real_tokens
    assert not actual[:n].isnan().any()
    torch.testing.assert_close(actual[:n], expected[:n], **TOL[dtype])
    return case


# (cached context_len, query_len) per batch row
CASES = {
    "single_prefill": [(0, 37)],
    "single_decode": [(50, 1)],
    "decode_rows": [(5, 1), (40, 1), (17, 1), (0, 1)],
    "prefill_rows": [(0, 20), (0, 33)],
    "mixed": [(13, 20), (0, 1), (30, 3), (7, 1), (0, 40)],
    "chunk_mid_sequence": [(45, 18), (16, 16)],
    "empty_rows": [(10, 1), (0, 0), (20, 1), (0, 0)],  # CUDA-graph padding rows: no tokens, no keys
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_matches_reference(name, block_size):
    _check_attention(CASES[name], block_size=block_size, num_pad_tokens=2 if name == "mixed" else 0)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 1), (6, 2), (14, 2)])
def test_gqa_groups(num_heads, num_kv_heads):
    """MHA, a group of 4, and groups of 3 and 7 (not powers of two: tile rows past BLOCK_Q * GROUP unused)."""
    _check_attention(CASES["mixed"][:4], num_heads=num_heads, num_kv_heads=num_kv_heads)


def test_float16_and_head_dim_128():
    _check_attention([(21, 1), (3, 30), (40, 2)], dtype=torch.float16, head_dim=128, num_heads=2, num_kv_heads=1)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", ["mixed", "decode_rows", "chunk_mid_sequence"])
def test_fp8_cache_matches_reference(name, cache_dtype):
    """Both launches read an FP8 cache as the reference does (each element to the query's dtype, then the same
    attention): the fp32 tolerance holds."""
    case = _check_attention(CASES[name], cache_dtype=cache_dtype, num_pad_tokens=2)
    assert case.kv_cache.dtype == cache_dtype


def test_fp8_cache_float16_head_dim_128_with_splits():
    _check_attention(
        [(70, 1), (21, 1), (3, 30), (40, 2)],
        dtype=torch.float16,
        head_dim=128,
        num_heads=4,
        num_kv_heads=2,
        cache_dtype=torch.float8_e4m3fn,
        block_size=4,
    )
    _check_attention([(70, 1), (2, 1), (33, 1)], num_splits=3, block_size=4, cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "rows", [[(70, 1), (21, 1), (40, 1), (0, 1)], [(13, 20), (0, 1), (30, 3), (0, 40)]], ids=["decode", "mixed"]
)
def test_fp8_cache_products_in_float16(cache_dtype, rows):
    """A bfloat16 query over an FP8 cache multiplies in float16 (q and the tiles converted; exact for the cache's
    values): decode, split decode and the prefill kernel stay within bf16's tolerance of the float32 reference."""
    assert tpa.products_in_f16(cache_dtype, torch.bfloat16)
    assert not tpa.products_in_f16(cache_dtype, torch.float32)
    assert not tpa.products_in_f16(torch.bfloat16, torch.bfloat16)
    case = make_paged_case(
        rows, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=torch.bfloat16, cache_dtype=cache_dtype
    )
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    expected = paged_attention_reference(case.query.float(), case.kv_cache, case.meta, 0.125)
    n = case.num_real_tokens
    for splits in (1, 3):
        actual = tpa.paged_attention(case.query, case.kv_cache, case.meta, 0.125, num_splits=splits)
        torch.testing.assert_close(actual[:n].float(), expected[:n], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size, block_n", [(32, 16), (16, 32), (4, 16)])
def test_pages_larger_and_smaller_than_kv_tile(block_size, block_n):
    small = lc.AttentionTiles(16, block_n, 4, 1)
    large = lc.AttentionTiles(32, block_n, 4, 1)
    _check_attention([(37, 1), (30, 25), (70, 3)], block_size=block_size, small_tiles=small, large_tiles=large)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_decode_with_kv_splits(num_splits):
    """Splits of unequal rows (some rows leave splits empty) merge to the unsplit result."""
    _check_attention([(70, 1), (2, 1), (33, 1), (16, 1)], num_splits=num_splits, block_size=4)


@pytest.mark.parametrize("name", ["decode_rows", "empty_rows", "mixed"])
def test_row_order_changes_only_the_launch_order(name):
    """Unsplit small rows launched row by row in a given order (longest first, or any permutation) give the
    unordered launch's output bit for bit, padding rows and mixed batches (prefill rows beside) included;
    a split launch ignores the order."""
    case = _check_attention(CASES[name], num_splits=1, num_heads=4, num_kv_heads=2)
    scale, n = 1 / math.sqrt(64), case.num_real_tokens
    plain = tpa.paged_attention(case.query, case.kv_cache, case.meta, scale, num_splits=1)[:n]
    longest = rows_longest_first(case.meta.seq_lens)
    lens = case.meta.seq_lens[longest.long()]
    assert longest.dtype == torch.int32 and bool((lens[:-1] >= lens[1:]).all())
    reversed_order = torch.arange(case.meta.num_rows - 1, -1, -1, dtype=torch.int32)
    for order in (longest, reversed_order):
        for splits in (1, 3):
            out = tpa.paged_attention(case.query, case.kv_cache, case.meta, scale, num_splits=splits, row_order=order)[
                :n
            ]
            assert torch.equal(out, plain) if splits == 1 else torch.allclose(out, plain, **TOL[torch.float32])


@pytest.mark.parametrize("num_rows, max_len", [(1, 5), (7, 3), (130, 4), (300, 2000), (0, 1)])
def test_rows_longest_first_kernel_is_a_stable_descending_sort(num_rows, max_len):
    """The rank kernel against `torch.argsort(stable=True)`: many ties (lengths 1..3 over 130 rows), more rows
    than one program places (130, 300), no rows."""
    lens = torch.randint(
        1, max_len + 1, (num_rows,), generator=torch.Generator().manual_seed(num_rows), dtype=torch.int32
    )
    order = rows_longest_first_triton(lens)
    assert order.dtype == torch.int32 and torch.equal(order, rows_longest_first_reference(lens))
    assert torch.equal(rows_longest_first(lens), order)  # the CPU dispatch: the reference


def test_draft_verify_rows_split_causally():
    """Rows of a few tokens (verifying drafts) in the split path: a split can hold no key for early queries."""
    _check_attention([(60, 4), (1, 3), (17, 8)], num_splits=4, num_heads=4, num_kv_heads=2)


def test_rejects_unsupported_shapes():
    case = make_paged_case([(3, 2)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    with pytest.raises(AssertionError, match="head_dim"):
        tpa.paged_attention(case.query[..., :48], case.kv_cache[..., :48], case.meta, 1.0)
    bad_pages = case.kv_cache.view(2, -1, 8, 1, 64)[:, :, :6]  # block_size 6
    with pytest.raises(AssertionError, match="block_size"):
        tpa.paged_attention(case.query, bad_pages, case.meta, 1.0)


def test_dispatcher_choice_and_override():
    assert attention_backend(torch.device("cpu"), 64) == "reference"
    assert attention_backend(torch.device("cuda"), 128) == "triton"
    assert attention_backend(torch.device("cuda"), 96) == "reference"  # no kernel for that head_dim
    assert attention_backend(torch.device("cuda"), 128, "reference") == "reference"  # kernels.backend=reference
    with pytest.raises(ValueError, match="kernels.backend"):
        attention_backend(torch.device("cpu"), 64, "bogus")
    # Forced Triton on the CPU runs the interpreted kernels through the same entry point as the model.
    case = make_paged_case(
        [(9, 1), (0, 5)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=4, dtype=torch.float32, poison=False
    )
    torch.testing.assert_close(
        dispatched_attention(case.query, case.kv_cache, case.meta, 0.1, backend="triton"),
        paged_attention_reference(case.query, case.kv_cache, case.meta, 0.1),
        **TOL[torch.float32],
    )


def test_many_prefill_rows_shorter_than_a_query_tile():
    """Regression (found on the H200): with GPU-sized query tiles, rows of many sub-tile prefills have
    non-compact tile ids (row r starts at query_start_loc[r] // BLOCK_Q + r); the grid must reach the last one."""
    large = lc.AttentionTiles(64, 16, 4, 1)  # BLOCK_Q = 32 tokens with a GQA group of 2
    small = lc.AttentionTiles(16, 16, 4, 1)
    _check_attention([(0, 5), (0, 16), (0, 27), (0, 30), (0, 31), (0, 29)], small_tiles=small, large_tiles=large)


def test_tiny_model_generates_the_same_tokens_with_triton(tiny_llm_factory, monkeypatch):
    """End to end through the model's two call sites: chunked prefill (mixed batches) and decode; the
    `kernels.backend` key reaches them through the loader, the model and its layers."""
    from framework import SamplingParams

    prompts = [[5, 17, 99, 3, 250, 8, 61, 42, 7, 13, 200], [77, 1, 2, 150, 33, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    settings = dict(block_size=4, max_num_batched_tokens=8)
    reference = tiny_llm_factory(**settings, kernel_backend="reference")
    expected = [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    calls = []
    kernel_entry = tpa.paged_attention

    def counted(*args, **kwargs):
        calls.append(args[2].max_query_len)
        return kernel_entry(*args, **kwargs)

    monkeypatch.setattr(tpa, "paged_attention", counted)
    triton = tiny_llm_factory(**settings, kernel_backend="triton")
    actual = [o.token_ids for o in triton.generate(prompts, params, use_tqdm=False)]
    assert actual == expected
    assert max(calls) > 1 and min(calls) == 1  # prefill chunks and decode steps both ran in Triton


# ------------------------------------------------------------- when a GPU module compiled the kernels first
_fresh_outcomes: dict[str, str] = {}  # read at call time: a negative control swaps in its own
if COMPILED_FIRST:
    for _name, _test in list(globals().items()):
        if _name.startswith("test_") and callable(_test):
            globals()[_name] = from_a_fresh_process(_test, __file__, lambda: _fresh_outcomes)
