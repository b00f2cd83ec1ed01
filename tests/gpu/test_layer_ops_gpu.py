"""Fused per-layer Triton kernels against their PyTorch references at real shapes, on a CUDA GPU.

Qwen3-0.6B geometry: hidden 1024, intermediate 3072, 16 query heads, 8 KV heads, head_dim 128, bfloat16, KV
blocks of 16 tokens, up to 256 tokens. The kernels round every intermediate as eager PyTorch does, so outputs
may differ from the reference only where a different `rsqrt` / `exp` / summation order tips a rounding: at
least 99.5% of the elements bit-identical, the rest within 2 bf16 ulps (of the value or of the tensor's rms).
Also: one compiled variant per kernel across batch sizes (CUDA-graph replays at many sizes must not compile
mid-run), and the dispatchers running with host syncs raising and capturing into a CUDA graph.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_layer_ops_gpu.py`
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from framework.entrypoints.bench.triton_compiles import compiled_variants, new_variants  # noqa: E402
from framework.layers.attention.qk_norm_rope import qk_norm_rope_store, qk_norm_rope_store_reference  # noqa: E402
from framework.layers.kernels.layer_ops import (  # noqa: E402
    rms_norm,
    rms_norm_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from framework.layers.kernels.triton_norm_silu import rms_norm_triton, silu_and_mul_triton  # noqa: E402
from framework.layers.kernels.triton_qk_norm_rope import ONE_HEAD_TOKENS, qk_norm_rope_store_triton  # noqa: E402

DEVICE = "cuda"
DTYPE = torch.bfloat16
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, EPS = 1024, 3072, 16, 8, 128, 1e-6
BLOCK_SIZE, NUM_BLOCKS = 16, 64
KERNELS = ("_rms_norm_kernel", "_silu_and_mul_kernel", "_qk_norm_rope_store_kernel")


def _randn(*shape: int, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEVICE) * scale + shift).to(DTYPE)


def _assert_ulp_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """At least 99.5% of the elements bit-identical; the rest within 2 bf16 ulps of the row scale (a flipped
    rounding before the weight multiply or the RoPE sums can grow, and RoPE's differences cancel)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    finite = ref[~ref.isnan()].float()
    scale = finite.pow(2).mean().sqrt().item() if finite.numel() else 0.0
    torch.testing.assert_close(out, ref, rtol=2**-6, atol=2**-6 * scale, equal_nan=True)
    same = (out == ref) | (out.isnan() & ref.isnan())
    assert same.float().mean().item() >= 0.995, f"only {same.float().mean().item():.4f} of elements bit-identical"


class QKInputs:
    """A merged q/k/v projection output with RoPE tables, norm weights, KV slots (padding and T' < T) and a
    NaN-poisoned cache."""

    def __init__(self, num_tokens: int, num_kv_tokens: int, seed: int = 0) -> None:
        self.qkv = _randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, seed=seed, scale=2.0)
        g = torch.Generator().manual_seed(seed)
        positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(DEVICE).float()
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE).float() / HEAD_DIM))
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
        self.q_weight = _randn(HEAD_DIM, seed=seed + 1, scale=0.2, shift=1.0)
        self.k_weight = _randn(HEAD_DIM, seed=seed + 2, scale=0.2, shift=1.0)
        slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:num_kv_tokens]
        slots[3::7] = -1  # padding tokens
        self.kv_slots = slots.to(DEVICE)
        self.cache = torch.full(
            (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), float("nan"), dtype=DTYPE, device=DEVICE
        )

    def args(self, with_norm: bool) -> tuple:
        weights = (self.q_weight, self.k_weight) if with_norm else (None, None)
        return (self.qkv, self.cos, self.sin, *weights, EPS, HEADS, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("num_rows", [1, 7, 256])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(num_rows, with_residual):
    x = _randn(num_rows, HIDDEN, seed=num_rows, scale=3.0)
    residual = _randn(num_rows, HIDDEN, seed=99, scale=5.0) if with_residual else None
    weight = _randn(HIDDEN, seed=5, scale=0.2, shift=1.0)
    out, summed = rms_norm_triton(x, weight, EPS, residual)
    ref_out, ref_summed = rms_norm_reference(x, weight, EPS, residual)
    _assert_ulp_close(out, ref_out)
    if with_residual:
        assert summed is not None and torch.equal(summed, ref_summed)
    q_heads = _randn(num_rows * HEADS, HEAD_DIM, seed=3)  # the per-head q norm of the unmerged path
    _assert_ulp_close(
        rms_norm_triton(q_heads, weight[:HEAD_DIM], EPS)[0], rms_norm_reference(q_heads, weight[:HEAD_DIM], EPS)[0]
    )


@pytest.mark.parametrize("num_rows", [1, 256])
def test_silu_and_mul(num_rows):
    gate_up = _randn(num_rows, 2 * INTER, seed=num_rows, scale=4.0)
    _assert_ulp_close(silu_and_mul_triton(gate_up), silu_and_mul_reference(gate_up))


@pytest.mark.parametrize("with_norm", [False, True])  # Llama (no q/k norm) and Qwen3
@pytest.mark.parametrize("num_tokens, num_kv_tokens", [(1, 1), (256, 256), (256, 250)])
def test_qk_norm_rope_store(with_norm, num_tokens, num_kv_tokens):
    inputs = QKInputs(num_tokens, num_kv_tokens)
    ref_cache = inputs.cache.clone()
    q = qk_norm_rope_store_triton(*inputs.args(with_norm), inputs.cache, inputs.kv_slots)
    ref_q = qk_norm_rope_store_reference(*inputs.args(with_norm), ref_cache, inputs.kv_slots)
    _assert_ulp_close(q, ref_q)
    _assert_ulp_close(inputs.cache, ref_cache)
    assert torch.equal(inputs.cache.isnan(), ref_cache.isnan())  # the same rows written, the rest untouched


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("num_tokens", [1, 256])
def test_qk_norm_rope_store_fp8_cache(cache_dtype, num_tokens):
    """Into an FP8 cache: the stored bytes are torch's rounding of the reference's bf16 K and V wherever the two
    bf16 values agree (at least 99.5 % of them; see `_assert_ulp_close`)."""
    inputs = QKInputs(num_tokens, num_tokens, seed=num_tokens)
    inputs.cache = inputs.cache.to(cache_dtype)
    ref_cache = inputs.cache.clone()
    q = qk_norm_rope_store_triton(*inputs.args(True), inputs.cache, inputs.kv_slots)
    ref_q = qk_norm_rope_store_reference(*inputs.args(True), ref_cache, inputs.kv_slots)
    _assert_ulp_close(q, ref_q)
    same = inputs.cache.view(torch.uint8) == ref_cache.view(torch.uint8)
    assert same.float().mean().item() >= 0.995, f"only {same.float().mean().item():.4f} of the bytes agree"
    torch.testing.assert_close(inputs.cache.float(), ref_cache.float(), rtol=2**-2, atol=2**-6, equal_nan=True)


def test_one_compiled_variant_across_batch_sizes():
    """Per-step sizes are not specialised: after warm-up calls, other batch sizes compile nothing (q/k norm +
    RoPE has two grids, one head per program up to ONE_HEAD_TOKENS and token x head tiles above: one warm-up
    call each)."""
    weight = _randn(HIDDEN, seed=1)

    def run(num_tokens: int) -> None:
        x = _randn(num_tokens, HIDDEN, seed=num_tokens)
        rms_norm_triton(x, weight, EPS, x)
        silu_and_mul_triton(_randn(num_tokens, 2 * INTER, seed=2))
        inputs = QKInputs(num_tokens, max(num_tokens - 3, 1))
        qk_norm_rope_store_triton(*inputs.args(True), inputs.cache, inputs.kv_slots)

    run(1)
    run(ONE_HEAD_TOKENS + 1)
    before = compiled_variants()
    assert all(
        before.get(f"framework.layers.kernels.{m}.{k}", 0) >= 1
        for m, k in (
            ("triton_norm_silu", KERNELS[0]),
            ("triton_norm_silu", KERNELS[1]),
            ("triton_qk_norm_rope", KERNELS[2]),
        )
    )
    for num_tokens in (2, 3, 16, 17, 64, 255, 256, 512):
        run(num_tokens)
    torch.cuda.synchronize()
    assert new_variants(before, compiled_variants()) == {}


def test_cuda_graph_capture_without_host_sync():
    """The three ops run with host syncs raising, capture into one CUDA graph, and replays read the new inputs."""
    inputs = QKInputs(64, 60, seed=4)
    x, residual = _randn(64, HIDDEN, seed=1), _randn(64, HIDDEN, seed=2)
    weight = _randn(HIDDEN, seed=3, scale=0.2, shift=1.0)
    gate_up = _randn(64, 2 * INTER, seed=5)

    def step() -> tuple[torch.Tensor, ...]:  # through the dispatchers, as the model calls them
        out, summed = rms_norm(x, weight, EPS, residual)
        q = qk_norm_rope_store(*inputs.args(True), inputs.cache, inputs.kv_slots)
        return out, summed, silu_and_mul(gate_up), q

    expected = [t.clone() for t in step()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the wrappers never wait for the device
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync inside a capture would fail it too
        outs = step()
    for t in (x, gate_up, inputs.qkv):
        t.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert not any(torch.equal(o, e) for o, e in zip(outs, expected))
    for t in (x, gate_up, inputs.qkv):
        t.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    for o, e in zip(outs, expected):
        torch.testing.assert_close(o, e, rtol=0, atol=0)
