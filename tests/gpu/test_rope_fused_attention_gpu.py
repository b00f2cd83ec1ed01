"""Decode attention with the q/k norm + RoPE + KV store fused in (`paged_attention(rope=...)`) against the two
launches it replaces, at real shapes on a CUDA GPU: the Qwen3-0.6B and Qwen3-8B attention geometries (16 or 32
query heads, 8 KV heads, head_dim 128, bfloat16, 16-token KV blocks), decode batches of 1-256 rows of up to
2,048 keys with the engine's tile and split rules, longest rows first at large batches, and one CUDA-graph
replay. Skipped without CUDA.

The stored keys may differ from the two-launch path's in the last bit where the per-head RMS (a float32 sum of
squares) is reduced in another order: at most 0.1 % of the stored elements may differ, by one bfloat16 step;
values are copied and must match exactly. Outputs: within bfloat16 rounding of the two-launch result.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from framework.attention.metadata import RopeInputs  # noqa: E402
from framework.attention.row_order import rows_longest_first  # noqa: E402
from framework.attention.triton_paged_attention import paged_attention  # noqa: E402
from framework.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared case builder
from attention_cases import make_paged_case  # noqa: E402

DEVICE = "cuda"
HEAD_DIM = 128


def _case(batch: int, num_heads: int, seed: int, max_seq: int = 2048):
    g = torch.Generator().manual_seed(seed)
    rows = [(n - 1, 1) for n in torch.randint(1, max_seq + 1, (batch,), generator=g).tolist()]
    case = make_paged_case(rows, num_heads=num_heads, num_kv_heads=8, head_dim=HEAD_DIM, block_size=16,
                           dtype=torch.bfloat16, device=DEVICE, num_pad_tokens=3, seed=seed)
    gd = torch.Generator(device=DEVICE).manual_seed(seed)
    t = case.query.shape[0]
    qkv = (torch.randn(t, (num_heads + 16) * HEAD_DIM, generator=gd, device=DEVICE) * 2).to(torch.bfloat16)
    positions = torch.tensor([c for c, _ in rows] + [0] * 3, device=DEVICE, dtype=torch.float32)
    inv_freq = 1e6 ** (-torch.arange(0, HEAD_DIM, 2, device=DEVICE).float() / HEAD_DIM)
    emb = torch.cat([positions[:, None] * inv_freq[None, :]] * 2, dim=-1)
    w = (torch.rand(2, HEAD_DIM, generator=gd, device=DEVICE) + 0.5).to(torch.bfloat16)
    rope = RopeInputs(emb.cos().bfloat16(), emb.sin().bfloat16(), w[0], w[1], 1e-6, case.meta.kv_slot_mapping)
    return case, qkv, rope


def _two_launches(case, qkv, rope, num_heads, cache, **kwargs):
    q = qk_norm_rope_store_triton(qkv, rope.cos, rope.sin, rope.q_norm_weight, rope.k_norm_weight, rope.eps,
                                  num_heads, 8, HEAD_DIM, cache, rope.kv_slot_mapping)
    return paged_attention(q, cache, case.meta, 1 / math.sqrt(HEAD_DIM), **kwargs)


def _fused(case, qkv, rope, num_heads, cache, **kwargs):
    raw_q = qkv[:, : num_heads * HEAD_DIM].view(qkv.shape[0], num_heads, HEAD_DIM)
    return paged_attention(raw_q, cache, case.meta, 1 / math.sqrt(HEAD_DIM), rope=rope, **kwargs)


def _assert_caches_match(cache: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(cache[1], expected[1], atol=0, rtol=0, equal_nan=True)  # values: copied
    k, k_ref = cache[0].float().nan_to_num(7.0), expected[0].float().nan_to_num(7.0)
    differ = k != k_ref
    assert differ.sum().item() <= 1e-3 * k.numel(), f"{differ.sum().item()} key elements differ"
    assert ((k - k_ref).abs() <= k_ref.abs() * 2**-7 + 1e-6)[differ].all(), "a key differs by more than a step"


@pytest.mark.parametrize("num_heads", [16, 32])
@pytest.mark.parametrize("batch", [1, 16, 96, 256])
def test_fused_matches_two_launches(batch, num_heads):
    case, qkv, rope = _case(batch, num_heads, seed=batch + num_heads)
    order = rows_longest_first(case.meta.seq_lens) if batch >= 64 else None
    expected_cache, cache = case.kv_cache.clone(), case.kv_cache.clone()
    expected = _two_launches(case, qkv, rope, num_heads, expected_cache, row_order=order)
    actual = _fused(case, qkv, rope, num_heads, cache, row_order=order)
    _assert_caches_match(cache, expected_cache)
    n = case.num_real_tokens
    assert torch.isfinite(actual[:n]).all()
    torch.testing.assert_close(actual[:n].float(), expected[:n].float(), atol=2e-2, rtol=2e-2)
    assert (actual[:n].float() - expected[:n].float()).abs().mean().item() < 1e-3


def test_fused_launch_replays_in_a_cuda_graph():
    """Captured once, replayed on new q/k/v: the same as an eager fused launch on them, bit for bit."""
    case, qkv, rope = _case(64, 16, seed=5)
    cache = case.kv_cache.clone()
    _fused(case, qkv, rope, 16, cache)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fused(case, qkv, rope, 16, cache)
    qkv.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    eager_cache = case.kv_cache.clone()
    expected = _fused(case, qkv, rope, 16, eager_cache)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(cache, eager_cache, atol=0, rtol=0, equal_nan=True)
