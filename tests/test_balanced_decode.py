"""Decode attention with the KV tiles shared out equally (framework/attention/triton_balanced_decode.py), on the
CPU interpreter, against `paged_attention_reference`.

Rows of mixed lengths are cut into runs of equal tile counts, so rows are shared by 1..many programs and merged
by the last one to finish: checked at 1 program per KV head up to more programs than tiles (the surplus leave),
GQA groups 1/2/4, KV tiles shorter and longer than a page, padding rows of no token (nothing written: the output
keeps its fill), a row of one key; the counters must be zero after every call. Unused cache memory holds NaN, so
a read past a row's keys shows. A negative control: merging with one program too few (a row's partial left out)
must fail the same comparison.
"""

from __future__ import annotations

import os

import pytest
import torch

from attention_cases import make_paged_case

from triton.runtime.interpreter import InterpretedFunction

from framework.attention import triton_balanced_decode as tbd
from framework.attention.launch_config import AttentionTiles
from framework.attention.paged import paged_attention_reference, store_kv_reference

# Decorated at import: compiled if a GPU test module imported it first in this process (then these interpreter
# tests skip); scripts/triton_cuda_compile_check.py imports it compiled on purpose (and only compiles).
COMPILED_FIRST = not isinstance(tbd._balanced_decode_kernel, InterpretedFunction) \
    and os.environ.get("TRITON_INTERPRET") == "1"

HEAD_DIM = 32  # small heads: the interpreter's cost grows with the tile sizes

ROWS = {  # (cached context_len, query_len) per batch row
    "mixed_lengths": [(70, 1), (0, 1), (150, 1), (33, 1), (15, 1)],
    "one_long_row": [(250, 1)],
    "padding_rows": [(40, 1), (0, 0), (90, 1), (0, 0)],
}


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run(rows, *, num_heads, num_kv_heads, block_size, block_n, programs, seed=0):
    case = make_paged_case(rows, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM,
                           block_size=block_size, dtype=torch.float32, seed=seed)
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    counters = torch.zeros(len(rows) * num_kv_heads, dtype=torch.int32)
    out = torch.full_like(case.query, 7.0)
    tbd.balanced_decode_attention(case.query, case.kv_cache, case.meta, HEAD_DIM ** -0.5, counters,
                                  num_programs=programs, tiles=AttentionTiles(16, block_n, 4, 1), out=out)
    ref = paged_attention_reference(case.query, case.kv_cache, case.meta, HEAD_DIM ** -0.5)
    return case, out, ref, counters


@pytest.mark.skipif(COMPILED_FIRST, reason="kernels compiled by a GPU module first: run in a fresh process")
@pytest.mark.parametrize("rows_name", list(ROWS))
@pytest.mark.parametrize("programs", [1, 3, 8, 64])
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size, block_n", [
    (4, 2, 16, 16),  # GQA 2, one page per tile
    (4, 4, 8, 32),  # MHA, a tile spans four pages
    (8, 2, 32, 16),  # GQA 4, two tiles per page
])
def test_balanced_decode_matches_reference(rows_name, programs, num_heads, num_kv_heads, block_size, block_n):
    rows = ROWS[rows_name]
    case, out, ref, counters = _run(rows, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size,
                                    block_n=block_n, programs=programs)
    starts = case.meta.query_start_loc.tolist()
    for r, (_, q_len) in enumerate(rows):
        if q_len:
            torch.testing.assert_close(out[starts[r]], ref[starts[r]], rtol=1e-5, atol=1e-5)
    assert out[case.num_real_tokens:].eq(7.0).all(), "wrote past the batch's tokens"
    assert counters.eq(0).all(), "a counter was left nonzero"


@pytest.mark.skipif(COMPILED_FIRST, reason="kernels compiled by a GPU module first: run in a fresh process")
def test_balanced_decode_negative_control(monkeypatch):
    """Planted fault: the merge sees one program fewer than a shared row has. The comparison above must fail."""
    real = tbd._merge_row_parts

    def short_merge(*args, **kwargs):  # count is the sixth argument: drop a row's last partial
        args = list(args)
        args[5] = args[5] - 1
        return real(*args, **kwargs)

    monkeypatch.setattr(tbd, "_merge_row_parts", short_merge)
    with pytest.raises(AssertionError):
        rows = ROWS["one_long_row"]
        case, out, ref, _ = _run(rows, num_heads=4, num_kv_heads=2, block_size=16, block_n=16, programs=3)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
