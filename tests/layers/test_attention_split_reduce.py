"""Split-KV decode with the reduce fused into the attention launch, on the CPU interpreter.

The last program of each (batch row, KV head) to finish merges the KV splits, found with an atomic counter
that it resets (docs/kernels.md). Checked against `paged_attention_reference` and, bit for bit, against the
two-launch path (`fused_reduce=False`), at mixed row lengths (short rows leave splits empty), 1..16 splits,
GQA groups 1/2/4/8, pages smaller and larger than a KV tile, a row of one key, draft-verify rows and padding
rows; the counters must be zero after every call; the merge unrolled by 2/4/8 splits equals the one-at-a-time
merge bit for bit (steps past the last split must be identities). A negative control leaves the counters as a
kernel without the reset would, and the same check must then fail. Kernels are imported under the interpreter as in
tests/layers/test_attention_triton.py (whose fresh-process fallback this module shares).
"""

from __future__ import annotations

import math

import pytest
import test_attention_triton as tat
import torch

tpa, lc = tat.tpa, tat.lc
from helpers.fresh_process import from_a_fresh_process  # noqa: E402
from test_attention_triton import make_paged_case, paged_attention_reference, store_kv_reference  # noqa: E402

HEAD_DIM = 32  # small heads: the interpreter's cost grows with the tile sizes
BLOCK_N = tpa.decode_tiles(HEAD_DIM, 1, False).block_n  # 16 keys per KV tile under the interpreter

# (cached context_len, query_len) per batch row
ROWS = {
    "mixed_lengths": [(70, 1), (0, 1), (150, 1), (33, 1), (15, 1)],  # row 1 has one key; 150 vs 1: empty splits
    "one_long_row": [(250, 1)],
    "padding_rows": [(40, 1), (0, 0), (90, 1), (0, 0)],  # CUDA-graph padding: no token, no count
    "draft_verify": [(60, 4), (1, 3), (17, 2)],  # a split may hold no key visible to an early query
}


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _case(rows, *, num_heads, num_kv_heads, block_size, seed=0):
    case = make_paged_case(
        rows,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        block_size=block_size,
        dtype=torch.float32,
        seed=seed,
    )
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    return case


def _used_splits(seq_len: int, num_splits: int) -> int:
    """Non-empty KV splits of a row (the kernel's `_split_len` rule)."""
    split_len = -(-(-(-seq_len // num_splits)) // BLOCK_N) * BLOCK_N
    return -(-seq_len // split_len)


def _fused_equals_reference_and_unfused(case, num_splits: int, counters: torch.Tensor) -> bool:
    """One fused call: equal to the reference (float32 tolerance) and to the two-launch path (bitwise)."""
    scale = 1 / math.sqrt(HEAD_DIM)
    n = case.num_real_tokens
    fused = tpa.paged_attention(
        case.query, case.kv_cache, case.meta, scale, num_splits=num_splits, split_counters=counters
    )[:n]
    unfused = tpa.paged_attention(
        case.query, case.kv_cache, case.meta, scale, num_splits=num_splits, fused_reduce=False
    )[:n]
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, scale)[:n]
    return bool(torch.equal(fused, unfused) and torch.allclose(fused, expected, **tat.TOL[torch.float32]))


@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 16])
def test_fused_reduce_matches_reference_and_unfused(name, num_splits):
    case = _case(ROWS[name], num_heads=4, num_kv_heads=2, block_size=4)
    counters = torch.zeros(64, dtype=torch.int32)  # more slots than rows x KV heads: the rest stay untouched
    assert _fused_equals_reference_and_unfused(case, num_splits, counters)
    assert not counters.any()


@pytest.mark.parametrize("merge_unroll", [2, 4, 8])
def test_unrolled_merge_equals_one_split_at_a_time(merge_unroll):
    """5 and 16 splits (steps past the last split: lse -inf, o 0), mixed rows (short rows' empty splits)."""
    case = _case(ROWS["mixed_lengths"], num_heads=8, num_kv_heads=2, block_size=4, seed=merge_unroll)
    scale, n = 1 / math.sqrt(HEAD_DIM), case.num_real_tokens
    counters = torch.zeros(64, dtype=torch.int32)
    for num_splits in (5, 16):
        outs = [
            tpa.paged_attention(
                case.query,
                case.kv_cache,
                case.meta,
                scale,
                num_splits=num_splits,
                split_counters=counters,
                merge_unroll=unroll,
            )[:n]
            for unroll in (1, merge_unroll)
        ]
        assert torch.equal(outs[0], outs[1]), num_splits
    assert not counters.any()


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_fused_reduce_gqa_groups_and_pages(num_heads, num_kv_heads, block_size):
    """Groups of 1/2/4/8 query heads per KV head; pages smaller than, equal to and larger than a KV tile."""
    case = _case(
        ROWS["mixed_lengths"], num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size, seed=block_size
    )
    counters = torch.zeros(len(ROWS["mixed_lengths"]) * num_kv_heads, dtype=torch.int32)
    assert _fused_equals_reference_and_unfused(case, 4, counters)
    assert not counters.any()


def test_counters_reused_across_calls_and_negative_control():
    """Step after step on one buffer (as every layer and graph replay does) stays right; a buffer left as a
    kernel without the reset would leave it (each counter at its row's number of non-empty splits) is wrong."""
    rows, num_splits = ROWS["mixed_lengths"], 5
    counters = torch.zeros(len(rows) * 2, dtype=torch.int32)
    for seed in range(3):  # new queries each step, so a missing merge cannot pass on a stale output
        case = _case(rows, num_heads=4, num_kv_heads=2, block_size=4, seed=seed)
        assert _fused_equals_reference_and_unfused(case, num_splits, counters)
        assert not counters.any()
    # The planted fault: after a step, the counters hold what counting without the reset leaves.
    stale = torch.tensor([_used_splits(c + q, num_splits) for c, q in rows], dtype=torch.int32)
    assert stale.tolist() == [5, 1, 5, 3, 1]  # short rows count fewer splits (the 1-key row only one)
    counters.copy_(stale.repeat_interleave(2))
    case = _case(rows, num_heads=4, num_kv_heads=2, block_size=4, seed=7)
    assert not _fused_equals_reference_and_unfused(case, num_splits, counters)


def test_without_counters_the_wrapper_zeroes_its_own():
    case = _case(ROWS["mixed_lengths"], num_heads=4, num_kv_heads=2, block_size=4)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = tpa.paged_attention(case.query, case.kv_cache, case.meta, scale, num_splits=3)
    expected = paged_attention_reference(case.query, case.kv_cache, case.meta, scale)
    torch.testing.assert_close(out, expected, **tat.TOL[torch.float32])


def test_split_counters_owner(monkeypatch):
    """`SplitCounters` hands out one zeroed buffer per device, grows it (keeping the old one for graphs that
    captured it), and the model's entry point leaves it zero."""
    from framework.layers.attention.backend import SplitCounters, paged_attention

    owner = SplitCounters()
    cpu = torch.device("cpu")
    first = owner.get(cpu, 10)
    assert first is not None and first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert owner.get(cpu, 10) is first
    bigger = owner.get(cpu, first.numel() + 1)
    assert bigger is not None and bigger.numel() > first.numel() and owner.get(cpu, 5) is bigger
    assert any(b is first for b in owner._outgrown)

    rows = [(600, 1), (3, 1)]
    case = _case(rows, num_heads=4, num_kv_heads=2, block_size=16)
    assert lc.num_kv_splits(len(rows), 2, case.meta.max_seq_len, tpa.num_sms(cpu), BLOCK_N) > 1  # split by rule
    out = paged_attention(case.query, case.kv_cache, case.meta, 0.2, split_counters=owner, backend="triton")
    torch.testing.assert_close(
        out, paged_attention_reference(case.query, case.kv_cache, case.meta, 0.2), **tat.TOL[torch.float32]
    )
    assert not bigger.any()


_fresh_outcomes: dict[str, str] = {}
if tat.COMPILED_FIRST:  # a GPU module compiled the kernels first: report this module's run in a fresh process
    for _name, _test in list(globals().items()):
        if _name.startswith("test_") and callable(_test):
            globals()[_name] = from_a_fresh_process(_test, __file__, lambda: _fresh_outcomes)
