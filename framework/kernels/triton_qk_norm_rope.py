"""Per-head q/k RMSNorm + RoPE + KV-cache store of a merged q/k/v projection, in one Triton launch.

Semantics are `qk_norm_rope_store_reference` (framework/kernels/layer_ops.py): split the `[T, (H + 2 Hkv) D]`
projection into heads, RMS-normalise each q and k head when a weight is given (Qwen3), rotate by half-split
RoPE, return q `[T, H, D]` and write k and the raw v at each token's KV slot (negative = padding, skipped).
Every intermediate the reference rounds to dtype (normalised head, weight product, each RoPE product, their
sum) is rounded here too.

Grid `(T, H + Hkv)`: program `(token, head)` owns one head vector of one token; heads `0..H-1` are query
heads, `H..H+Hkv-1` key heads, and a key-head program also moves the matching value head. A head is handled
as its two halves (RoPE pairs element `i` with `i + D/2`), so no register shuffles are needed.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.kernels.pdl import pdl_launch_kwargs
from framework.kernels.triton_norm_silu import round_to_dtype


@triton.jit
def _rms_norm_halves(x1, x2, weight_ptr, dims, mask, eps, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, dtype):
    """weight * rmsnorm([x1, x2]) for heads given as their two halves along the last axis (float32 holding dtype
    values): one head `[HALF]` each, or a tile of heads `[rows, HALF]` (the fused attention's,
    framework/attention/triton_rope_attention.py), each row normalised on its own."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=-1, keep_dims=True) + tl.sum(x2 * x2, axis=-1, keep_dims=True))
                    / HEAD_DIM + eps)
    w1 = tl.load(weight_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    y1 = round_to_dtype(w1 * round_to_dtype(x1 * rstd, dtype), dtype)
    y2 = round_to_dtype(w2 * round_to_dtype(x2 * rstd, dtype), dtype)
    return y1, y2


@triton.jit
def _rope_halves(x1, x2, c1, c2, s1, s2, dtype):
    """[x1, x2] * cos + [-x2, x1] * sin with each product and the sum rounded to dtype (as eager PyTorch)."""
    o1 = round_to_dtype(round_to_dtype(x1 * c1, dtype) + round_to_dtype(-x2 * s1, dtype), dtype)
    o2 = round_to_dtype(round_to_dtype(x2 * c2, dtype) + round_to_dtype(x1 * s2, dtype), dtype)
    return o1.to(dtype), o2.to(dtype)


@triton.jit(do_not_specialize=["num_kv_tokens"])  # per-step sizes: no recompiles mid-run
def _qk_norm_rope_store_kernel(
    qkv_ptr,  # [T, (H + 2 Hkv) * D], row stride stride_qkv: q heads, then k heads, then v heads
    cos_ptr,  # [T, D], row stride stride_cos
    sin_ptr,  # [T, D], row stride stride_sin
    q_weight_ptr,  # [D] (qkv_ptr again when HAS_Q_NORM is False; not read)
    k_weight_ptr,  # [D] (qkv_ptr again when HAS_K_NORM is False; not read)
    q_out_ptr,  # [T, H, D] contiguous
    cache_ptr,  # [2, num_blocks, block_size, Hkv, D], head_dim contiguous
    kv_slot_ptr,  # [T'] int64: KV slot of token t < T', negative = padding
    num_kv_tokens,  # T'
    stride_qkv, stride_cos, stride_sin,
    stride_c_kv, stride_c_slot, stride_c_head,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= HEAD_DIM // 2
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (framework/kernels/pdl.py)
):
    if USE_PDL:  # qkv, cos / sin and the KV slots are all written by earlier kernels of the step
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    head = tl.program_id(1)  # < NUM_HEADS: query head; else key head head - NUM_HEADS
    token64 = token.to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    HALF = HEAD_DIM // 2  # constexpr arithmetic stays constexpr
    dims = tl.arange(0, BLOCK_HALF)
    mask = dims < HALF
    src = qkv_ptr + token64 * stride_qkv + head * HEAD_DIM  # q and k heads are adjacent: head * D either way
    x1 = tl.load(src + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + token64 * stride_cos + dims, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + token64 * stride_cos + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + token64 * stride_sin + dims, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + token64 * stride_sin + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    if head < NUM_HEADS:
        if HAS_Q_NORM:
            x1, x2 = _rms_norm_halves(x1, x2, q_weight_ptr, dims, mask, eps, HALF, HEAD_DIM, dtype)
        q1, q2 = _rope_halves(x1, x2, c1, c2, s1, s2, dtype)
        q_dst = q_out_ptr + (token64 * NUM_HEADS + head) * HEAD_DIM
        tl.store(q_dst + dims, q1, mask=mask)
        tl.store(q_dst + HALF + dims, q2, mask=mask)
    else:
        kv_slot = tl.load(kv_slot_ptr + token64, mask=token < num_kv_tokens, other=-1).to(tl.int64)
        if kv_slot >= 0:  # tokens past T' and padding tokens store nothing
            if HAS_K_NORM:
                x1, x2 = _rms_norm_halves(x1, x2, k_weight_ptr, dims, mask, eps, HALF, HEAD_DIM, dtype)
            k1, k2 = _rope_halves(x1, x2, c1, c2, s1, s2, dtype)
            # The cache viewed as [2, num_blocks * block_size, Hkv, D]: a KV slot is a row of the middle axis.
            kv_dst = cache_ptr + kv_slot * stride_c_slot + (head - NUM_HEADS) * stride_c_head
            cache_dtype = cache_ptr.dtype.element_ty
            tl.store(kv_dst + dims, k1.to(cache_dtype), mask=mask)
            tl.store(kv_dst + HALF + dims, k2.to(cache_dtype), mask=mask)
            v_src = src + NUM_KV_HEADS * HEAD_DIM  # v head j sits Hkv heads after k head j
            v1 = tl.load(v_src + dims, mask=mask)
            v2 = tl.load(v_src + HALF + dims, mask=mask)
            tl.store(kv_dst + stride_c_kv + dims, v1.to(cache_dtype), mask=mask)
            tl.store(kv_dst + stride_c_kv + HALF + dims, v2.to(cache_dtype), mask=mask)


def qk_norm_rope_store_triton(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D] bf16/fp16/fp32, last dim contiguous
    cos: torch.Tensor,  # [T, D] qkv.dtype, last dim contiguous (cat([freqs, freqs]).cos())
    sin: torch.Tensor,  # [T, D] qkv.dtype, last dim contiguous
    q_norm_weight: Optional[torch.Tensor],  # [D] qkv.dtype, or None: no q norm
    k_norm_weight: Optional[torch.Tensor],  # [D] qkv.dtype, or None: no k norm
    eps: float,
    num_heads: int,  # H
    num_kv_heads: int,  # Hkv
    head_dim: int,  # D, even
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], updated in place
    kv_slot_mapping: torch.Tensor,  # [T'] int64 KV slots (block * block_size + offset) of tokens 0..T'-1,
    # T' <= T, negative = padding (skipped)
    pdl: bool = False,  # programmatic dependent launch (only where `pdl.pdl_supported`)
) -> torch.Tensor:
    """q [T, H, D] contiguous (normed + roped); normed + roped k and raw v of the first T' tokens go to the cache."""
    num_tokens = qkv.shape[0]
    assert head_dim % 2 == 0, f"RoPE needs an even head_dim, got {head_dim}"
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1, "bad qkv layout"
    assert cos.shape == (num_tokens, head_dim) and sin.shape == cos.shape, "cos/sin must be [T, head_dim]"
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.dtype == qkv.dtype and sin.dtype == qkv.dtype
    for weight in (q_norm_weight, k_norm_weight):
        assert weight is None or (weight.shape == (head_dim,) and weight.stride(0) == 1 and weight.dtype == qkv.dtype)
    _, _, block_size, cache_heads, cache_dim = kv_cache.shape
    assert (cache_heads, cache_dim) == (num_kv_heads, head_dim), "cache heads / head_dim differ from the model's"
    # A KV slot indexes blocks and offsets together, which needs the two axes to be one uniform stride.
    assert kv_cache.stride(1) == block_size * kv_cache.stride(2) and kv_cache.stride(4) == 1, "bad cache layout"
    assert kv_slot_mapping.numel() <= num_tokens, "more KV slots than tokens"
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    block_half = triton.next_power_of_2(head_dim // 2)
    _qk_norm_rope_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, cos, sin,
        q_norm_weight if q_norm_weight is not None else qkv,
        k_norm_weight if k_norm_weight is not None else qkv,
        q, kv_cache, kv_slot_mapping, kv_slot_mapping.numel(),
        qkv.stride(0), cos.stride(0), sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HALF=block_half,
        HAS_Q_NORM=q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None,
        num_warps=1 if block_half <= 64 else 2,
        **pdl_launch_kwargs(pdl),
    )
    return q
