"""Triton KV store and paged attention against the PyTorch references at real shapes, on a CUDA GPU.

Geometry of Qwen3-0.6B (16 query heads, 8 KV heads, head_dim 128, bfloat16, KV blocks of 16 tokens), batches
of 1 to 256 rows, sequences up to 4096 keys, prefill chunks of 2048 tokens; and Gemma 4's full layers (head_dim
512). Skipped without CUDA.

Tolerances: both the kernel output and the reference run in the test dtype are compared with a float32
reference on the same data (float32 copies of the bf16 inputs), elementwise |out - ref32| <= atol + rtol *
|ref32| with atol = rtol = 2e-2 for bfloat16 (its spacing is 2^-7 relative) and 4e-3 for float16; and the
kernel's mean absolute error must not exceed twice that of the bf16/fp16 reference plus 1e-4.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_attention_gpu.py`
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from helpers.attention_cases import make_paged_case  # noqa: E402

from framework.layers.attention.paged import paged_attention_reference, store_kv_reference  # noqa: E402
from framework.layers.attention.triton_paged_attention import decode_tiles, num_kv_splits, paged_attention  # noqa: E402
from framework.layers.attention.triton_store_kv import store_kv  # noqa: E402
from framework.runner.graphs.cuda_graphs import CudaGraphCapturer  # noqa: E402

DEVICE = "cuda"
QWEN3 = dict(num_heads=16, num_kv_heads=8, head_dim=128)
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _rows(kind: str, batch: int, max_seq: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_seq + 1, (batch,), generator=g).tolist()
    if kind == "decode_equal":
        return [(max_seq - 1, 1)] * batch
    if kind == "decode":
        return [(n - 1, 1) for n in lens]
    if kind == "verify":  # draft verification: 4 tokens per row
        return [(max(n - 4, 0), 4) for n in lens]
    raise ValueError(kind)


def _check(rows, *, dtype=torch.bfloat16, block_size=16, num_pad_tokens=0, seed=0, cache_dtype=None, **shape):
    shape = {**QWEN3, **shape}
    case = make_paged_case(
        rows,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        num_pad_tokens=num_pad_tokens,
        seed=seed,
        poison=True,
        cache_dtype=cache_dtype,
        **shape,
    )
    triton_cache = case.kv_cache.clone()
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    store_kv(case.key, case.value, triton_cache, case.meta.kv_slot_mapping)
    if cache_dtype is None:
        torch.testing.assert_close(triton_cache, case.kv_cache, atol=0, rtol=0, equal_nan=True)
    else:  # FP8: the GPU's rounding of every new K and V is torch's, byte for byte (NaN poison included)
        assert torch.equal(triton_cache.view(torch.uint8), case.kv_cache.view(torch.uint8))

    scale = 1 / math.sqrt(shape["head_dim"])
    n = case.num_real_tokens
    out = paged_attention(case.query, case.kv_cache, case.meta, scale)[:n].float()
    ref = paged_attention_reference(case.query, case.kv_cache, case.meta, scale)[:n].float()
    ref32 = paged_attention_reference(case.query.float(), case.kv_cache.float(), case.meta, scale)[:n]
    assert torch.isfinite(out).all()
    tol = TOL[dtype]
    torch.testing.assert_close(out, ref32, atol=tol, rtol=tol)
    err, ref_err = (out - ref32).abs().mean().item(), (ref - ref32).abs().mean().item()
    assert err <= 2 * ref_err + 1e-4, (err, ref_err)


@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("kind", ["decode", "decode_equal"])
def test_decode_qwen3(batch, kind):
    _check(_rows(kind, batch, 4096, seed=batch))


@pytest.mark.parametrize("batch, block_n, num_warps", [(48, 128, 4), (96, 64, 4), (256, 64, 2)])
def test_decode_tiles_of_each_regime(batch, block_n, num_warps):
    """Short contexts (<= 2,048 keys, nano's): the tile rule's three decode configs, each against the reference."""
    rows = _rows("decode", batch, 2048, seed=batch)
    tiles = decode_tiles(
        128,
        2,
        True,
        2,
        num_programs=batch * 8,
        max_seq_len=max(c + q for c, q in rows),
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
    )
    assert (tiles.block_n, tiles.num_warps) == (block_n, num_warps)
    _check(rows)


@pytest.mark.parametrize("batch", [1, 16])
def test_draft_verify_rows(batch):
    _check(_rows("verify", batch, 4096, seed=batch))


@pytest.mark.parametrize(
    "rows",
    [
        [(0, 2048)],  # a fresh prompt chunk
        [(2048, 2048)],  # second chunk of a long prompt: cached prefix + new tokens
        [(1000, 2048), (0, 333), (3000, 1)],  # unaligned prefix, short prompt, a decode row
        [(4000, 1)] * 100 + [(1500, 2048)],  # continuous batching: many decodes + one chunk
    ],
    ids=["fresh", "prefix", "mixed", "decodes_plus_chunk"],
)
def test_prefill_qwen3(rows):
    _check(rows, num_pad_tokens=5)


# Gemma 4's full layers (`global_head_dim` 512): 31B's 32 query heads over 4 KV heads, 26B-A4B's 16 over 2.
GEMMA4_31B = dict(num_heads=32, num_kv_heads=4, head_dim=512)
GEMMA4_26B = dict(num_heads=16, num_kv_heads=2, head_dim=512)


@pytest.mark.parametrize(
    "rows, shape",
    [
        (_rows("decode", 1, 4096, seed=1), GEMMA4_31B),  # split decode
        (_rows("decode", 96, 2048, seed=2), GEMMA4_31B),  # a full GPU of decode rows
        (_rows("verify", 16, 2048, seed=3), GEMMA4_31B),
        ([(1000, 700), (0, 333), (3000, 1)], GEMMA4_31B),  # the prefill kernel and a decode row in one call
        ([(1000, 700), (0, 333), (3000, 1)], GEMMA4_26B),
    ],
    ids=["31b-decode1", "31b-decode96", "31b-verify", "31b-mixed", "26b-mixed"],
)
def test_head_dim_512_gemma4_full_layers(rows, shape):
    """The 512-wide tiles (launch_config.WIDE_*_TILES) at real shapes, bfloat16, against the float32 reference."""
    _check(rows, num_pad_tokens=3, **shape)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode_fp8_cache(batch, cache_dtype):
    """Decode over an FP8 cache (`cache.kv_cache_dtype`): the kernel reads each element into bf16 as the
    reference does; the float32 yardstick runs on the same dequantized cache."""
    _check(_rows("decode", batch, 4096, seed=batch), cache_dtype=cache_dtype)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_prefill_and_verify_fp8_cache(cache_dtype):
    _check([(1000, 2048), (0, 333), (3000, 1)], num_pad_tokens=5, cache_dtype=cache_dtype)
    _check(_rows("verify", 64, 2048, seed=3), cache_dtype=cache_dtype)


def test_store_kv_fp8_saturates_and_rounds_like_torch():
    """Values past e4m3's range (448) and below its normals (2^-6) alike: the GPU's conversion gives torch's
    bytes (round to nearest even, saturating)."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    key = (torch.randn(4096, 8, 128, generator=g, device=DEVICE) * 200).to(torch.bfloat16)
    value = (torch.randn(4096, 8, 128, generator=g, device=DEVICE) * 1e-2).to(torch.bfloat16)
    kv_slots = torch.randperm(8192, device=DEVICE)[:4096]
    for cache_dtype in FP8:
        expected = torch.zeros(2, 512, 16, 8, 128, dtype=cache_dtype, device=DEVICE)
        actual = torch.zeros_like(expected)
        store_kv_reference(key, value, expected, kv_slots)
        store_kv(key, value, actual, kv_slots)
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)), cache_dtype
        assert torch.isfinite(actual.float()).all()
    assert (key.abs() > 448).any() and (value.abs() < 2**-6).any()


@pytest.mark.parametrize("block_size", [1, 64])
def test_block_sizes(block_size):
    _check([(700, 1), (300, 200), (1200, 3)], block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        dict(num_heads=8, num_kv_heads=8, head_dim=64),  # MHA, head_dim 64
        dict(num_heads=28, num_kv_heads=4, head_dim=128),  # group of 7 (Qwen2-7B)
        dict(num_heads=32, num_kv_heads=8, head_dim=128),  # group of 4 (Llama-3-8B)
    ],
)
def test_other_geometries(dtype, shape):
    _check([(2000, 1), (10, 1), (500, 300), (0, 64)], dtype=dtype, **shape)


def test_every_split_count_matches():
    """The split path at each count the rule can choose, on one batch of unequal rows."""
    rows = _rows("decode", 3, 3000, seed=5)
    case = make_paged_case(rows, block_size=16, dtype=torch.bfloat16, device=DEVICE, **QWEN3)
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    base = paged_attention(case.query, case.kv_cache, case.meta, 0.088, num_splits=1).float()
    for splits in (2, 3, 8, 17, 32):
        out = paged_attention(case.query, case.kv_cache, case.meta, 0.088, num_splits=splits).float()
        torch.testing.assert_close(out, base, atol=1e-2, rtol=1e-2)
    assert num_kv_splits(3, 8, 3000, torch.cuda.get_device_properties(0).multi_processor_count) > 1


def test_store_kv_large_batch():
    g = torch.Generator().manual_seed(0)
    num_tokens, num_blocks, block_size = 8192, 1024, 16
    kv_slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    kv_slots[::7] = -1
    key = torch.randn(num_tokens, 8, 128, generator=g).to(DEVICE, torch.bfloat16)
    value = torch.randn(num_tokens, 8, 128, generator=g).to(DEVICE, torch.bfloat16)
    kv_slots = kv_slots.to(DEVICE)
    expected = torch.zeros(2, num_blocks, block_size, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    actual = torch.zeros_like(expected)
    store_kv_reference(key, value, expected, kv_slots)
    store_kv(key, value, actual, kv_slots)
    assert torch.equal(actual, expected)


def _captured(step):  # type: ignore[no-untyped-def]
    """(graph, its output): `step` captured as the runner captures its decode graphs (`CudaGraphCapturer`: warmed
    up on a side stream first, so the capture holds no compile)."""
    capturer = CudaGraphCapturer()
    replay = capturer.capture(step)
    capturer.finish()
    return replay, replay.out


def test_cuda_graph_capture_and_replay():
    """The step path has no host sync: attention + store capture into a CUDA graph and replay correctly."""
    rows = _rows("decode", 32, 2048, seed=9)
    case = make_paged_case(rows, block_size=16, dtype=torch.bfloat16, device=DEVICE, poison=False, **QWEN3)
    meta = case.meta

    def step():
        store_kv(case.key, case.value, case.kv_cache, meta.kv_slot_mapping)
        return paged_attention(case.query, case.kv_cache, meta, 0.088)

    expected = step().clone()
    graph, out = _captured(step)
    case.query.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, expected)  # the replay read the new queries
    case.query.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("batch", [64, 256])
def test_longest_rows_first_same_bits_in_a_graph(batch):
    """Large mixed-length decode batches launched longest rows first (the model's row order, computed inside
    the captured forward) give the batch-order launch's output bit for bit, replay after replay as the lengths
    change; the order (the rank kernel, inside the graph) is the stable descending argsort of the lengths."""
    from framework.layers.attention.backend import order_rows_longest_first
    from framework.layers.attention.row_order import rows_longest_first_reference

    rows = _rows("decode", batch, 2048, seed=batch + 1)
    case = make_paged_case(rows, block_size=16, dtype=torch.bfloat16, device=DEVICE, poison=False, **QWEN3)
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    meta = dataclasses.replace(case.meta, max_seq_len=2048)  # as the decode graphs see it: nano's max_model_len
    ordered_meta: list = []

    def step():
        ordered_meta[:] = [order_rows_longest_first(meta)]
        return paged_attention(case.query, case.kv_cache, ordered_meta[0], 0.088)

    graph, out = _captured(step)
    order, base = ordered_meta[0].row_order, case.meta.seq_lens.clone()
    for shrink in (0, 7, 300):  # rows lose keys between replays: the order inside the graph follows
        meta.seq_lens.copy_(torch.clamp(base - shrink * (torch.arange(batch, device=DEVICE) % 3), min=1))
        graph.replay()
        plain = paged_attention(case.query, case.kv_cache, meta, 0.088)
        torch.cuda.synchronize()
        assert torch.equal(out[:batch], plain[:batch]), shrink
        assert torch.equal(order, rows_longest_first_reference(meta.seq_lens)), shrink  # the kernel, replayed


# ------------------------------------------------------------------ split-KV decode with the reduce fused in


def _decode_case(rows, seed=0):
    case = make_paged_case(rows, block_size=16, dtype=torch.bfloat16, device=DEVICE, seed=seed, **QWEN3)
    store_kv_reference(case.key, case.value, case.kv_cache, case.meta.kv_slot_mapping)
    return case


def _references(case) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 and float32 PyTorch references of a case (real tokens only, as float32)."""
    n = case.num_real_tokens
    return (
        paged_attention_reference(case.query, case.kv_cache, case.meta, 0.088)[:n].float(),
        paged_attention_reference(case.query.float(), case.kv_cache.float(), case.meta, 0.088)[:n],
    )


def _assert_matches_reference(out: torch.Tensor, case, refs=None) -> None:
    """The `_check` criteria: within bf16 tolerance of a float32 reference, mean error no worse than twice
    that of the bf16 PyTorch reference."""
    ref, ref32 = refs or _references(case)
    out = out[: case.num_real_tokens].float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref32, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    err, ref_err = (out - ref32).abs().mean().item(), (ref - ref32).abs().mean().item()
    assert err <= 2 * ref_err + 1e-4, (err, ref_err)


@pytest.mark.parametrize(
    "batch, max_seq", [(1, 4096), (1, 600), (4, 4096), (16, 2048), (16, 4096), (64, 4096), (64, 2048), (256, 1024)]
)  # the last two: 64-key decode tiles
def test_fused_reduce_qwen3(batch, max_seq):
    """Rows of random lengths 1..max_seq (short rows leave splits empty), at the rule's split count and at 16
    splits: equal to the reference and to the two-launch reduce; the counters are zero afterwards."""
    case = _decode_case(_rows("decode", batch, max_seq, seed=batch) + [(0, 1)], seed=batch)  # + a 1-key row
    rows = batch + 1
    counters = torch.zeros(rows * QWEN3["num_kv_heads"] + 8, dtype=torch.int32, device=DEVICE)
    refs = _references(case)
    for splits in (None, 16):
        fused = paged_attention(case.query, case.kv_cache, case.meta, 0.088, num_splits=splits, split_counters=counters)
        unfused = paged_attention(case.query, case.kv_cache, case.meta, 0.088, num_splits=splits, fused_reduce=False)
        torch.cuda.synchronize()
        assert not counters.any()
        _assert_matches_reference(fused, case, refs)
        # Same merge arithmetic in both paths: equal up to the compiler's choice of fused multiply-adds.
        torch.testing.assert_close(fused.float(), unfused.float(), atol=1e-3, rtol=1e-2)


def test_fused_reduce_stale_counters_fail():
    """Negative control: counters left as a kernel without the reset leaves them (one count per non-empty
    split) make the next call skip its merges, and the reference check notices."""
    case = _decode_case(_rows("decode_equal", 2, 4096, seed=0))
    counters = torch.zeros(2 * QWEN3["num_kv_heads"], dtype=torch.int32, device=DEVICE)
    out = paged_attention(case.query, case.kv_cache, case.meta, 0.088, num_splits=8, split_counters=counters)
    _assert_matches_reference(out, case)
    counters.fill_(8)  # 4096 keys in 8 splits: all non-empty
    case.query.neg_()  # new queries: a stale output cannot pass
    out = paged_attention(case.query, case.kv_cache, case.meta, 0.088, num_splits=8, split_counters=counters)
    with pytest.raises(AssertionError):
        _assert_matches_reference(out, case)


@pytest.mark.parametrize("batch", [1, 4, 16, 32])  # 32, 8, 2, 2 splits by the rule at 4096 keys
def test_fused_reduce_cuda_graph_changing_seq_lens(batch):
    """As the engine runs decode: max_seq_len fixed at 4096 (so the split count is fixed at capture), one
    counter buffer, the graph replayed with new sequence lengths and queries each time."""
    case = _decode_case([(4095, 1)] * batch, seed=batch)
    meta = dataclasses.replace(case.meta, max_seq_len=4096)
    counters = torch.zeros(batch * QWEN3["num_kv_heads"], dtype=torch.int32, device=DEVICE)
    tiles = decode_tiles(128, 2, True)
    assert num_kv_splits(batch, 8, 4096, torch.cuda.get_device_properties(0).multi_processor_count, tiles.block_n) > 1
    step = lambda: paged_attention(case.query, case.kv_cache, meta, 0.088, split_counters=counters)  # noqa: E731
    graph, out = _captured(step)
    g = torch.Generator().manual_seed(batch)
    for replay in range(5):
        seq_lens = torch.randint(1, 4097, (batch,), generator=g)
        seq_lens[0] = (1, 4096, 129, 2048, 17)[replay]
        meta.seq_lens.copy_(seq_lens)
        case.query.copy_(torch.randn(case.query.shape, generator=g).to(case.query))
        graph.replay()
        torch.cuda.synchronize()
        assert not counters.any(), replay
        _assert_matches_reference(out, case)
