"""Fused per-layer Triton kernels (RMSNorm + residual, SiLU-and-mul, q/k norm + RoPE + KV store) against their
PyTorch references, under the interpreter on the CPU (or for real on a GPU), on small awkward shapes.

The kernels round every intermediate the way eager PyTorch does, so bfloat16 results are bit-identical except
where another summation order / `rsqrt` / `exp` tips a rounding (rare: see `_assert_matches`); float32
differs by summation order only.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import framework.layers.attention.qk_norm_rope as qk_norm_rope
import framework.layers.kernels.layer_ops as layer_ops
from framework.layers.attention.qk_norm_rope import qk_norm_rope_store_reference
from framework.layers.kernels.layer_ops import rms_norm_reference, silu_and_mul_reference
from framework.layers.kernels.triton_norm_silu import rms_norm_triton, silu_and_mul_triton
from framework.layers.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(DEVICE, dtype)


def _strided_rows(rows: int, cols: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols] whose rows are `cols + 24` elements apart (a view into a wider tensor)."""
    return _randn((rows, cols + 24), dtype, seed, scale)[:, 5 : 5 + cols]


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: summation-order close. bf16/fp16: at most 1 + 0.5% of the elements differ at all (a flipped
    rounding, e.g. from numpy summing in another order), and those by 2 ulps of the row scale: a flip before
    the weight multiply or the RoPE sums can grow, and RoPE's differences cancel, so relative error alone
    would be the wrong yardstick."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
        return
    ulp = 2**-7 if ref.dtype == torch.bfloat16 else 2**-10
    finite = ref[~ref.isnan()].float()
    scale = finite.pow(2).mean().sqrt().item() if finite.numel() else 0.0
    torch.testing.assert_close(out, ref, rtol=2 * ulp, atol=2 * ulp * scale, equal_nan=True)
    differ = ((out != ref) & ~(out.isnan() & ref.isnan())).sum().item()
    assert differ <= 1 + 0.005 * ref.numel(), f"{differ} of {ref.numel()} elements differ from the reference"


# ---- RMSNorm -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 96])
@pytest.mark.parametrize("num_rows", [1, 3, 17])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, dim, num_rows, with_residual):
    x = _strided_rows(num_rows, dim, dtype, seed=dim + num_rows, scale=3.0)
    residual = _randn((num_rows, dim), dtype, seed=7, scale=2.0) if with_residual else None
    weight = _randn((dim,), dtype, seed=8, scale=0.2, shift=1.0)
    x_before = x.clone()
    out, summed = rms_norm_triton(x, weight, EPS, residual)
    ref_out, ref_summed = rms_norm_reference(x, weight, EPS, residual)
    _assert_matches(out, ref_out)
    if with_residual:
        assert summed is not None and torch.equal(summed, ref_summed)  # one rounded add: exact in every dtype
    else:
        assert summed is None
    assert torch.equal(x, x_before)  # inputs are not written


def test_rms_norm_float16_and_zero_rows():
    x = _randn((5, 128), torch.float16, seed=1, scale=4.0)
    residual = _randn((5, 128), torch.float16, seed=2)
    weight = _randn((128,), torch.float16, seed=3, scale=0.2, shift=1.0)
    out, summed = rms_norm_triton(x, weight, EPS, residual)
    ref_out, ref_summed = rms_norm_reference(x, weight, EPS, residual)
    _assert_matches(out, ref_out)
    assert summed is not None and torch.equal(summed, ref_summed)
    empty_out, empty_summed = rms_norm_triton(x[:0], weight, EPS, residual[:0])
    assert empty_out.shape == (0, 128) and empty_summed is not None and empty_summed.shape == (0, 128)


# ---- SiLU and mul --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [64, 96, 1100])  # 1100: two column blocks, the second partly masked
@pytest.mark.parametrize("num_rows", [1, 3, 17])
def test_silu_and_mul_matches_reference(dtype, inter, num_rows):
    gate_up = _strided_rows(num_rows, 2 * inter, dtype, seed=inter + num_rows, scale=4.0)
    out = silu_and_mul_triton(gate_up)
    _assert_matches(out, silu_and_mul_reference(gate_up))
    assert out.is_contiguous()


# ---- q/k norm + RoPE + KV store ------------------------------------------------------------------------

# (num_tokens, head_dim, num_heads, num_kv_heads, block_size, num_kv_tokens, padding tokens)
QK_CASES = [
    (1, 64, 4, 2, 16, 1, ()),
    (3, 128, 2, 2, 1, 3, (1,)),
    (3, 128, 4, 2, 16, 2, ()),  # last token has no KV slot (T' < T, as with CUDA-graph padding)
    (9, 64, 4, 2, 16, 7, (0, 5)),  # tiles of 8 tokens: a full one and a partial one
    (9, 64, 2, 2, 1, 9, (8,)),
    (5, 64, 6, 3, 16, 4, (2,)),  # head counts that are not powers of two: padded tile rows store nothing
]


def _rope_tables(num_tokens: int, head_dim: int, dtype: torch.dtype, seed: int):
    """cos, sin [T, D] as the model builds them: cat([freqs, freqs]) at arbitrary positions."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4000, (num_tokens,), generator=g).float()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


def _run_qk_case(
    case,
    dtype: torch.dtype,
    q_norm: bool,
    k_norm: bool,
    seed: int = 0,
    one_head: Optional[bool] = None,
    unit_offset: bool = False,
    float32_scale: bool = False,
) -> None:
    num_tokens, head_dim, num_heads, num_kv_heads, block_size, num_kv_tokens, padding = case
    num_blocks = 2 + 2 * num_tokens // block_size
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _strided_rows(num_tokens, width, dtype, seed=seed, scale=2.0)
    cos, sin = _rope_tables(num_tokens, head_dim, dtype, seed)
    q_weight: Optional[torch.Tensor] = _randn((head_dim,), dtype, 11, 0.2, 1.0) if q_norm else None
    k_weight: Optional[torch.Tensor] = _randn((head_dim,), dtype, 12, 0.2, 1.0) if k_norm else None
    g = torch.Generator().manual_seed(seed + 1)
    kv_slots = torch.randperm(num_blocks * block_size, generator=g)[:num_kv_tokens]  # any order, any block
    kv_slots[list(padding)] = -1
    kv_slots = kv_slots.to(DEVICE)
    # NaN poison: a store to a wrong row (or to a padding token's) shows up in the comparison.
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    ref_cache = cache.clone()
    args = (q_weight, k_weight, EPS, num_heads, num_kv_heads, head_dim)
    scales = {"unit_offset": unit_offset, "float32_scale": float32_scale}
    q = qk_norm_rope_store_triton(qkv, cos, sin, *args, cache, kv_slots, one_head=one_head, **scales)
    ref_q = qk_norm_rope_store_reference(qkv, cos, sin, *args, ref_cache, kv_slots, **scales)
    assert q.shape == (num_tokens, num_heads, head_dim) and q.is_contiguous()
    _assert_matches(q, ref_q)
    _assert_matches(cache, ref_cache)
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    written = kv_slots[kv_slots >= 0].cpu()
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert flat[:, untouched.to(DEVICE)].isnan().all()  # padding and unused slots left alone
    assert not flat[:, written.to(DEVICE)].isnan().any()
    token_of_slot = torch.nonzero(kv_slots.cpu() >= 0).flatten()
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    assert torch.equal(flat[1, written.to(DEVICE)], v[token_of_slot.to(DEVICE)])  # v is stored raw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("case", QK_CASES)
@pytest.mark.parametrize("one_head", [True, False], ids=["one_head", "tiles"])
def test_qk_norm_rope_store_matches_reference(case, dtype, qk_norm, one_head):
    """Both grids at every case: one head per program (decode) and token x head tiles (prefill)."""
    _run_qk_case(case, dtype, qk_norm, qk_norm, one_head=one_head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_head", [True, False], ids=["one_head", "tiles"])
def test_qk_norm_rope_store_with_gemma_norms(dtype, one_head):
    """Gemma's q/k norms (`unit_offset`: (1 + weight) in float32, rounded once) in both grids."""
    _run_qk_case(QK_CASES[1], dtype, True, True, seed=5, one_head=one_head, unit_offset=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_head", [True, False], ids=["one_head", "tiles"])
def test_qk_norm_rope_store_with_gemma4_norms(dtype, one_head):
    """Gemma 4's q/k norms (`float32_scale`: weight in float32, rounded once) in both grids."""
    _run_qk_case(QK_CASES[1], dtype, True, True, seed=6, one_head=one_head, float32_scale=True)


def test_qk_norm_rope_store_q_norm_only_and_float16():
    _run_qk_case(QK_CASES[1], torch.bfloat16, q_norm=True, k_norm=False, seed=3)
    _run_qk_case(QK_CASES[2], torch.float16, q_norm=False, k_norm=True, seed=4)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_store_into_an_fp8_cache(cache_dtype, dtype):
    """The KV store into an FP8 cache writes the reference's bytes, saturating past the format's range. At
    position 0 (cos 1, sin 0) without norms K is the projection itself, and the projection holds values the FP8
    type represents (plus a few past its range): Triton's interpreter rounds to FP8 wrongly (see
    test_attention_triton._on_fp8_grid), so rounding itself is left to tests/gpu/test_layer_ops_gpu.py."""
    num_tokens, head_dim, num_heads, num_kv_heads, block_size = 5, 64, 4, 2, 4
    width = (num_heads + 2 * num_kv_heads) * head_dim
    limit = torch.finfo(cache_dtype).max
    qkv = _randn((num_tokens, width), torch.float32, 5, 3.0).to(cache_dtype).float()
    qkv[:, num_heads * head_dim :][0, :3] = torch.tensor([2 * limit, -3 * limit, limit])  # K head 0 of token 0
    qkv = qkv.to(dtype)
    cos = torch.ones(num_tokens, head_dim, dtype=dtype, device=DEVICE)
    sin = torch.zeros(num_tokens, head_dim, dtype=dtype, device=DEVICE)
    kv_slots = torch.tensor([6, 0, -1, 11, 3], device=DEVICE)
    cache = torch.zeros(2, 4, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=DEVICE)
    ref_cache = cache.clone()
    args = (None, None, EPS, num_heads, num_kv_heads, head_dim)
    for one_head in (True, False):
        q = qk_norm_rope_store_triton(qkv, cos, sin, *args, cache, kv_slots, one_head=one_head)
        ref_q = qk_norm_rope_store_reference(qkv, cos, sin, *args, ref_cache, kv_slots)
        _assert_matches(q, ref_q)
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert cache[0].view(-1, num_kv_heads, head_dim)[6, 0, :3].float().tolist() == [limit, -limit, limit]
    assert cache.float().abs().sum() > 0 and torch.isfinite(cache.float()).all()


def test_qk_norm_rope_store_rejects_bad_shapes():
    qkv = torch.zeros(2, (4 + 2 * 2) * 64, device=DEVICE)
    cos = torch.zeros(2, 64, device=DEVICE)
    cache = torch.zeros(2, 4, 16, 2, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="qkv layout"):
        qk_norm_rope_store_triton(qkv, cos, cos, None, None, EPS, 4, 3, 64, cache, torch.zeros(2, dtype=torch.long))
    with pytest.raises(AssertionError, match="more KV slots than tokens"):
        qk_norm_rope_store_triton(qkv, cos, cos, None, None, EPS, 4, 2, 64, cache, torch.zeros(3, dtype=torch.long))


# ---- dispatch ------------------------------------------------------------------------------------------


T = "triton"  # `backend=T`: the Triton path forced, as `kernels.backend=triton` does


@pytest.fixture
def triton_spies(monkeypatch):
    """Record which Triton wrappers the dispatchers call (the tests force the Triton path with `backend=T`, as
    `kernels.backend=triton` does, and as CUDA's `auto` does)."""
    calls: list[str] = []
    for module, name in (
        (layer_ops, "rms_norm_triton"),
        (layer_ops, "silu_and_mul_triton"),
        (qk_norm_rope, "qk_norm_rope_store_triton"),
    ):
        wrapped = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _w=wrapped, _n=name, **k: (calls.append(_n), _w(*a, **k))[1])
    return calls


def test_dispatch_takes_triton_for_supported_inputs(triton_spies):
    x = _randn((3, 64), torch.bfloat16, 1)
    w = _randn((64,), torch.bfloat16, 2, 0.2, 1.0)
    _assert_matches(layer_ops.rms_norm(x, w, EPS, x, backend=T)[0], rms_norm_reference(x, w, EPS, x)[0])
    _assert_matches(layer_ops.silu_and_mul(x, T), silu_and_mul_reference(x))
    qkv = _randn((2, 4 * 32), torch.bfloat16, 3)
    cos, sin = _rope_tables(2, 32, torch.bfloat16, 0)
    cache = torch.zeros(2, 2, 4, 1, 32, dtype=torch.bfloat16, device=DEVICE)
    ref_cache = cache.clone()
    slots = torch.tensor([5, 2], device=DEVICE)
    q = qk_norm_rope.qk_norm_rope_store(qkv, cos, sin, w[:32], w[32:], EPS, 2, 1, 32, cache, slots, backend=T)
    _assert_matches(q, qk_norm_rope_store_reference(qkv, cos, sin, w[:32], w[32:], EPS, 2, 1, 32, ref_cache, slots))
    _assert_matches(cache, ref_cache)
    assert triton_spies == ["rms_norm_triton", "silu_and_mul_triton", "qk_norm_rope_store_triton"]


def test_dispatch_falls_back_to_the_reference_for_unsupported_inputs(triton_spies):
    wide = _randn((2, 8200), torch.float32, 1)  # a row longer than one program holds
    w = _randn((8200,), torch.float32, 2)
    out, _ = layer_ops.rms_norm(wide, w, EPS, backend=T)
    torch.testing.assert_close(out, rms_norm_reference(wide, w, EPS)[0], rtol=0, atol=0)
    x = _randn((3, 64), torch.bfloat16, 3)
    w32 = _randn((64,), torch.float32, 4)  # weight in another dtype: the reference promotes to float32
    assert layer_ops.rms_norm(x, w32, EPS, backend=T)[0].dtype == torch.float32
    x_cols = _randn((64, 3), torch.bfloat16, 5).t()  # last dim not contiguous
    layer_ops.rms_norm(x_cols, x_cols[0].contiguous(), EPS, backend=T)
    layer_ops.silu_and_mul(x_cols[:, :64], T)
    layer_ops.silu_and_mul(x.double(), T)
    qkv = _randn((2, 4 * 30), torch.bfloat16, 6)  # head_dim 30 is fine for the kernel; cos in float32 is not
    cos32, sin32 = _rope_tables(2, 30, torch.float32, 0)
    cache = torch.zeros(2, 2, 4, 1, 30, dtype=torch.bfloat16, device=DEVICE)
    q = qk_norm_rope.qk_norm_rope_store(
        qkv, cos32, sin32, None, None, EPS, 2, 1, 30, cache, torch.tensor([1, 0], device=DEVICE), backend=T
    )
    assert q.dtype == torch.float32  # the reference's type promotion
    assert triton_spies == []


def test_reference_switch_and_cpu_default_skip_triton(triton_spies):
    x = _randn((3, 64), torch.float32, 1)
    layer_ops.rms_norm(x, x[0], EPS, x, backend="reference")  # kernels.backend: the same setting as attention
    layer_ops.silu_and_mul(x, "reference")
    if DEVICE == "cpu":  # auto: the reference on a CPU
        layer_ops.rms_norm(x, x[0], EPS)
        layer_ops.silu_and_mul(x)
    assert triton_spies == []


def test_autograd_takes_the_reference(triton_spies):
    """Training needs gradients through the norms and the MLP; the kernels have none, so the reference runs."""
    x = _randn((3, 64), torch.float32, 1).requires_grad_()
    w = _randn((64,), torch.float32, 2, 0.2, 1.0).requires_grad_()
    out, _ = layer_ops.rms_norm(x, w, EPS, backend=T)
    (out.sum() + layer_ops.silu_and_mul(x, T).sum()).backward()
    assert x.grad is not None and w.grad is not None
    assert triton_spies == []
    with torch.no_grad():  # inference: the same tensors take the kernels
        layer_ops.rms_norm(x, w, EPS, backend=T)
    assert triton_spies == ["rms_norm_triton"]
