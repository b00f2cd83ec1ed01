"""Sliding-window and sink attention: the Triton kernels (decode, split decode, prefill, the older large-row
launch) against the PyTorch reference on the CPU interpreter, and the reference against a dense softmax written
here from the definitions (HF's sliding-window mask `kv > q - window`, gpt-oss's sink column).

Blocks a window no longer reads hold NaN in these tests: a kernel that read a KV tile wholly before every query's
window would turn its output into NaN (the interpreter's KV tiles are 16 or 32 keys; the pages 16 tokens, and
only the 32-key spans wholly before a row's first window are poisoned).
"""

from __future__ import annotations

import os

import pytest
import torch

_saved_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    from triton.runtime.interpreter import InterpretedFunction

    from framework.layers.attention import triton_paged_attention as tpa
    from framework.layers.attention import triton_prefill_attention as tpf
    from framework.layers.attention.backend import paged_attention as dispatched_attention
    from framework.layers.attention.paged import paged_attention_reference, store_kv_reference
finally:
    if _saved_interpret is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret

from helpers.attention_cases import PagedCase, make_paged_case  # noqa: E402
from helpers.fresh_process import from_a_fresh_process  # noqa: E402

COMPILED_FIRST = not isinstance(tpa._paged_attention_kernel, InterpretedFunction)  # a GPU test module imported them


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# (cached context_len, query_len) per batch row: decode rows far past the window, prefill chunks starting inside
# and past it, a draft-verify row, an empty (padding) row.
ROWS = [(70, 1), (0, 37), (45, 18), (30, 3), (0, 0), (5, 1), (100, 20)]
BLOCK_SIZE = 16
POISON_SPAN = 32  # keys: the largest KV tile of these tests


def _case(rows: list[tuple[int, int]], window: int, seed: int = 0, num_heads: int = 4) -> PagedCase:
    case = make_paged_case(
        rows, num_heads=num_heads, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE, dtype=torch.float32, seed=seed
    )
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    if window > 0:
        _poison_blocks_out_of_window(case, rows, window)
    return case


def _poison_blocks_out_of_window(case: PagedCase, rows: list[tuple[int, int]], window: int) -> None:
    """Blocks wholly before the window of a row's first query get NaN (as if handed to another request)."""
    cache = case.kv_cache
    for row, (context, query_len) in enumerate(rows):
        if query_len == 0:
            continue
        first_visible = max(context - window + 1, 0) // POISON_SPAN * POISON_SPAN
        for page in range(first_visible // BLOCK_SIZE):
            cache[:, int(case.meta.block_tables[row, page])] = float("nan")


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    # Large enough to matter against scores of order 1: some heads put most of their weight on the sink.
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0


def _dense(case: PagedCase, rows, scale: float, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention from the definitions: every row's full K/V gathered, the window and causal mask, the sinks."""
    out = torch.zeros_like(case.query)
    kv = case.kv_cache
    heads, kv_heads = case.query.shape[1], kv.shape[3]
    start = 0
    for row, (context, query_len) in enumerate(rows):
        seq = context + query_len
        pos = torch.arange(seq)
        slots = case.meta.block_tables[row, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k = kv[0].reshape(-1, kv_heads, kv.shape[4])[slots].repeat_interleave(heads // kv_heads, 1)
        v = kv[1].reshape(-1, kv_heads, kv.shape[4])[slots].repeat_interleave(heads // kv_heads, 1)
        for i in range(query_len):
            p = context + i
            visible = (pos <= p) & ((pos > p - window) if window > 0 else True)
            logits = torch.einsum("hd,shd->hs", case.query[start + i], k[visible].nan_to_num()) * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[:, None]], dim=1)
            probs = torch.softmax(logits, dim=1)[:, : int(visible.sum())]
            out[start + i] = torch.einsum("hs,shd->hd", probs, v[visible])
        start += query_len
    return out


@pytest.mark.parametrize("window, with_sinks", [(0, True), (1, False), (5, True), (37, False), (37, True)])
def test_reference_matches_the_definition(window, with_sinks):
    case = _case(ROWS, window)
    sinks = _sinks(4, window) if with_sinks else None
    expected = _dense(case, ROWS, 0.2, window, sinks)
    actual = paged_attention_reference(case.query, case.kv_cache, case.meta, 0.2, window, sinks)
    n = case.num_real_tokens
    torch.testing.assert_close(actual[:n], expected[:n], atol=2e-5, rtol=1e-4)


def _check(rows, window: int, with_sinks: bool, seed: int = 0, **kwargs) -> None:
    case = _case(rows, window, seed)
    sinks = _sinks(4, seed) if with_sinks else None
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, 0.2, window, sinks)
    actual = tpa.paged_attention(case.query, case.kv_cache, case.meta, 0.2, window=window, sinks=sinks, **kwargs)
    n = case.num_real_tokens
    assert not actual[:n].isnan().any(), "a KV tile wholly outside the window was read"
    torch.testing.assert_close(actual[:n], expected[:n], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window, with_sinks", [(1, False), (5, True), (16, True), (37, False), (500, True)])
def test_mixed_batch(window, with_sinks):
    _check(ROWS, window, with_sinks, seed=window)


@pytest.mark.parametrize(
    "num_splits, fused_reduce, window", [(2, True, 9), (3, True, 40), (3, False, 40), (2, False, 0)]
)
def test_split_decode(num_splits, fused_reduce, window):
    """Splits divide the keys from the window's first tile on; the sink joins the merge once."""
    rows = [(120, 1), (3, 1), (64, 1), (47, 2)]
    _check(rows, window, True, num_splits=num_splits, fused_reduce=fused_reduce)


def test_sinks_without_window_and_row_order():
    rows = [(70, 1), (5, 1), (33, 1)]
    _check(rows, 0, True, row_order=torch.tensor([2, 0, 1], dtype=torch.int32))


@pytest.mark.parametrize(
    "variant",
    ["qk_ahead=1", "prefetch_pages=0", "q_prescale=1,k_trans=0", "reverse=0,heads=1", "block_n=32"],
)
def test_prefill_variants(variant):
    base = tpf.default_variant(32, on_gpu=False)
    _check([(0, 50), (40, 33)], 21, True, prefill_variant=tpf.PrefillVariant.parse(variant, base))


def test_older_large_row_launch():
    _check([(0, 60), (50, 40), (10, 1)], 21, True, prefill_kernel=False)


def test_dispatcher_passes_window_and_sinks():
    case = _case(ROWS, 9)
    sinks = _sinks(4, 1)
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, 0.2, 9, sinks)
    for backend in ("triton", "reference"):
        actual = dispatched_attention(case.query, case.kv_cache, case.meta, 0.2, backend=backend, window=9, sinks=sinks)
        torch.testing.assert_close(actual[: case.num_real_tokens], expected[: case.num_real_tokens])


def test_negative_control_window_is_not_ignored():
    """The reference with the window dropped differs from the windowed one (the test above could not pass by
    accident), and so does one that leaves the sinks out."""
    case = _case([(0, 60), (50, 4)], 0)
    n = case.num_real_tokens
    full = paged_attention_reference(case.query, case.kv_cache, case.meta, 0.2)
    windowed = paged_attention_reference(case.query, case.kv_cache, case.meta, 0.2, 9)
    sinks = paged_attention_reference(case.query, case.kv_cache, case.meta, 0.2, 0, _sinks(4, 0))
    assert (full[:n] - windowed[:n]).abs().max() > 1e-2
    assert (full[:n] - sinks[:n]).abs().max() > 1e-2


_fresh_outcomes: dict[str, str] = {}
if COMPILED_FIRST:  # the same tests in a fresh interpreter process
    for _name, _test in list(globals().items()):
        if _name.startswith("test_") and callable(_test):
            globals()[_name] = from_a_fresh_process(_test, __file__, lambda: _fresh_outcomes)
