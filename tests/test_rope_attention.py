"""q/k norm + RoPE + KV store fused into the small-row attention launch, on the CPU interpreter.

Claim: `rope_paged_attention` (framework/attention/triton_rope_attention.py) equals
`qk_norm_rope_store_reference` then `paged_attention_reference`, in its output and in the KV cache it leaves,
on decode rows of mixed lengths (one of a single key), draft-verify rows whose new positions straddle a KV-split
boundary, padding tokens and rows (KV slot -1: the cache keeps its old value there), GQA groups of 1/2/4, with
and without q/k norm, 1..5 splits and pages of 4 and 16 tokens. Unused cache memory holds NaN, and the
interpreter runs programs one after another in grid order: a program that read a new position before its
owner stored it would read NaN. Negative controls (planted through the inputs): a store skipped, a store at
the wrong slot. Kernels are imported under the interpreter as in tests/test_attention_triton.py (whose
fresh-process fallback this module shares).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import test_attention_triton as tat

_saved_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    from framework.attention import triton_rope_attention as tra
    from framework.attention.launch_config import decode_tiles
    from framework.kernels.layer_ops import qk_norm_rope_store_reference
finally:
    if _saved_interpret is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret

from test_attention_triton import make_paged_case, paged_attention_reference  # noqa: E402

HEAD_DIM = 32  # small heads: the interpreter's cost grows with the tile sizes
BLOCK_N = decode_tiles(HEAD_DIM, 1, False).block_n  # 16 keys per KV tile under the interpreter
EPS = 1e-6
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}
CACHE_TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=1e-3, rtol=1e-3)}

# (cached context_len, query_len) per batch row. With 2 splits of the 16-key tiles, row (14, 4) stores
# positions 14, 15 in split 0 and 16, 17 in split 1; (29, 6) straddles 32 at 3 splits of 32 keys and more.
DECODE = [(70, 1), (0, 1), (33, 1), (15, 1), (150, 1)]  # one row of one key; 150 vs 1: empty splits
DRAFT = {1: [(14, 4), (29, 6), (0, 3), (47, 8), (31, 2)],  # draft-verify rows of 2-8 tokens
         2: [(14, 4), (29, 6), (0, 3), (47, 8), (31, 2)],
         4: [(14, 4), (29, 3), (0, 3), (47, 4), (31, 2)]}  # group 4: a row holds at most 16 // 4 tokens
STALE = 5.0  # what a padding token's slot held before the step (it must still hold it after)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _case(rows, *, group, block_size, dtype=torch.float32, qk_norm=True, pad_rows=(), pad_tokens=(),
          num_pad_tokens=2, seed=0):
    """(qkv, cos, sin, q weight, k weight, cache, meta, real token count, kv heads, heads) of one batch.

    `pad_rows`: rows whose tokens are CUDA-graph padding (KV slot -1); `pad_tokens`: single tokens with slot -1.
    Those slots are given a finite old value first (a padded token's position is read by its own row)."""
    num_kv_heads = 2
    num_heads = num_kv_heads * group
    case = make_paged_case(rows, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM,
                           block_size=block_size, dtype=dtype, num_pad_tokens=num_pad_tokens, seed=seed)
    slots = case.meta.kv_slot_mapping.clone()
    starts = case.meta.query_start_loc.tolist()
    padded = list(pad_tokens) + [t for r in pad_rows for t in range(starts[r], starts[r + 1])]
    flat = case.kv_cache.view(2, -1, num_kv_heads, HEAD_DIM)
    for t in padded:
        flat[:, slots[t]] = STALE
        slots[t] = -1
    meta = type(case.meta)(**{**case.meta.__dict__, "kv_slot_mapping": slots})
    t_pad = case.query.shape[0]
    g = torch.Generator().manual_seed(seed + 100)
    qkv = torch.randn(t_pad, (num_heads + 2 * num_kv_heads) * HEAD_DIM, generator=g).to(dtype)
    positions = torch.randint(0, 4000, (t_pad,), generator=g).float()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    weights = [(torch.rand(HEAD_DIM, generator=g) + 0.5).to(dtype) if qk_norm else None for _ in range(2)]
    return (qkv, emb.cos().to(dtype), emb.sin().to(dtype), weights[0], weights[1], case.kv_cache, meta,
            case.num_real_tokens, num_kv_heads, num_heads)


def _expected(case):
    """(output [T, H, D], cache after the step) of the two reference ops."""
    qkv, cos, sin, qw, kw, cache, meta, _, hkv, h = case
    cache = cache.clone()
    q = qk_norm_rope_store_reference(qkv, cos, sin, qw, kw, EPS, h, hkv, HEAD_DIM, cache, meta.kv_slot_mapping)
    return paged_attention_reference(q, cache, meta, 1 / math.sqrt(HEAD_DIM)), cache


def _fused(case, **kwargs):
    qkv, cos, sin, qw, kw, cache, meta, _, hkv, h = case
    cache = cache.clone()
    out = tra.rope_paged_attention(qkv, cos, sin, qw, kw, EPS, h, hkv, HEAD_DIM, cache, meta,
                                   1 / math.sqrt(HEAD_DIM), **kwargs)
    return out, cache


def _check_cache(cache: torch.Tensor, ref_cache: torch.Tensor) -> None:
    """Untouched memory bit for bit (NaN where nothing was ever stored, the old value under padding tokens),
    stored K/V within rounding (the norm's summation order)."""
    assert torch.equal(cache.isnan(), ref_cache.isnan())
    torch.testing.assert_close(cache.nan_to_num(123.0), ref_cache.nan_to_num(123.0), **CACHE_TOL[cache.dtype])


def _check(case, actual, expected) -> None:
    """Output within tolerance of the reference's (real tokens), and the cache as the reference leaves it."""
    (out, cache), (ref_out, ref_cache) = actual, expected
    n, dtype = case[7], case[0].dtype
    assert not out[:n].isnan().any()
    torch.testing.assert_close(out[:n], ref_out[:n], **TOL[dtype])
    _check_cache(cache, ref_cache)


# Splits 1, 2 (the draft rows straddle its boundary: test below) and 5 (empty splits), pages smaller than and
# equal to the KV tile; 3 and 4 splits add nothing those do not cover (the CI suite's time).
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3; Llama has none
@pytest.mark.parametrize("num_splits, block_size", [(1, 16), (2, 4), (5, 16)])
def test_decode_and_draft_rows_match_the_reference(group, qk_norm, num_splits, block_size):
    for rows in (DECODE, DRAFT[group]):
        case = _case(rows, group=group, block_size=block_size, qk_norm=qk_norm, seed=num_splits)
        counters = torch.zeros(64, dtype=torch.int32)
        _check(case, _fused(case, num_splits=num_splits, split_counters=counters), _expected(case))
        assert not counters.any()  # the merge's counters are left zero, as the unfused kernel leaves them


def test_draft_rows_straddle_a_split_boundary():
    """The straddling the draft cases rely on: at 2 splits row (14, 4) has new positions in both splits."""
    seq_len, splits = 18, 2
    split_len = -(-(-(-seq_len // splits)) // BLOCK_N) * BLOCK_N
    assert split_len == BLOCK_N and 14 < split_len < 18


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_rows_and_tokens_store_nothing(num_splits):
    """A CUDA-graph padding row (all its tokens slot -1), a padding token inside a draft row, and tokens past
    the last row: the cache keeps the old values there, and the output still equals the reference's."""
    rows = [(40, 1), (0, 1), (60, 4), (17, 3)]
    case = _case(rows, group=2, block_size=4, pad_rows=(1,), pad_tokens=(5,), num_pad_tokens=3)
    actual, expected = _fused(case, num_splits=num_splits), _expected(case)
    _check(case, actual, expected)
    assert (actual[1] == STALE).sum() == 2 * 2 * 2 * HEAD_DIM  # two padded tokens' K and V, 2 KV heads


def test_float16_and_the_two_launch_merge():
    case = _case(DRAFT[2], group=2, block_size=16, dtype=torch.float16)
    _check(case, _fused(case, num_splits=3), _expected(case))
    case = _case(DECODE, group=2, block_size=4)
    _check(case, _fused(case, num_splits=4, fused_reduce=False), _expected(case))


def test_matches_the_unfused_triton_path():
    """The two kernels it replaces, on the same inputs: same output (float32, summation order of the norm)."""
    from framework.attention.triton_paged_attention import paged_attention
    from framework.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton

    case = _case(DRAFT[2] + DECODE, group=2, block_size=16)
    qkv, cos, sin, qw, kw, cache, meta, n, hkv, h = case
    unfused_cache = cache.clone()
    q = qk_norm_rope_store_triton(qkv, cos, sin, qw, kw, EPS, h, hkv, HEAD_DIM, unfused_cache, meta.kv_slot_mapping)
    unfused = paged_attention(q, unfused_cache, meta, 1 / math.sqrt(HEAD_DIM), num_splits=3)
    fused, fused_cache = _fused(case, num_splits=3)
    torch.testing.assert_close(fused[:n], unfused[:n], atol=1e-6, rtol=1e-5)
    assert torch.equal(fused_cache.isnan(), unfused_cache.isnan())


@pytest.mark.parametrize("fault", ["skipped_store", "wrong_slot"])
def test_negative_controls(fault):
    """A store the kernel skips (a decode row's slot -1 given to the fused call only, as a kernel that never
    stores in its last split would leave it) or a store at the neighbouring slot: the cache check fails."""
    case = _case(DECODE, group=2, block_size=4, num_pad_tokens=0)
    expected = _expected(case)
    slots = case[6].kv_slot_mapping.clone()
    slots[2] = -1 if fault == "skipped_store" else slots[2] + 1
    planted = case[:6] + (type(case[6])(**{**case[6].__dict__, "kv_slot_mapping": slots}),) + case[7:]
    _check(case, _fused(case, num_splits=3), expected)  # unplanted: passes
    with pytest.raises(AssertionError):
        _check_cache(_fused(planted, num_splits=3)[1], expected[1])


def test_rejects_rows_that_are_not_small():
    case = _case([(3, 17)], group=1, block_size=16)
    with pytest.raises(AssertionError, match="rows of up to 16 tokens"):
        _fused(case)


def test_the_dispatch_takes_all_small_batches_on_the_triton_backend_only(monkeypatch):
    from framework.attention.backend import rope_attention_takes

    case = _case(DRAFT[2], group=2, block_size=16)
    qkv, cos, sin, qw, kw, cache, meta, _, _, h = case
    monkeypatch.setenv("MRV2_ATTENTION_BACKEND", "triton")
    assert rope_attention_takes(qkv, cos, sin, qw, kw, cache, meta, h)
    too_long = type(meta)(**{**meta.__dict__, "max_query_len": 9})  # a prefill row: 16 // 2 = 8 tokens at most
    assert not rope_attention_takes(qkv, cos, sin, qw, kw, cache, too_long, h)
    assert not rope_attention_takes(qkv, cos.to(torch.float16), sin, qw, kw, cache, meta, h)  # the reference's
    assert not rope_attention_takes(qkv.requires_grad_(), cos, sin, qw, kw, cache, meta, h)  # autograd
    monkeypatch.setenv("MRV2_ATTENTION_BACKEND", "reference")
    assert not rope_attention_takes(qkv.detach(), cos, sin, qw, kw, cache, meta, h)


_fresh_outcomes: dict[str, str] = {}
if tat.COMPILED_FIRST:  # a GPU module compiled the kernels first: report this module's run in a fresh process
    for _name, _test in list(globals().items()):
        if _name.startswith("test_") and callable(_test):
            globals()[_name] = tat._from_a_fresh_process(_test, __file__, _fresh_outcomes)
