"""KV-cache store in Triton: each token's K and V written at its KV slot of the paged cache.

Semantics are `store_kv_reference` (framework/layers/attention/paged.py): token `t` goes to KV slot
`kv_slot_mapping[t]` (= `block * block_size + offset`), a negative KV slot marks a padding token and is
skipped. One program per token moves all of its KV heads at once (`[num_kv_heads, head_dim]` for K, the
same for V), so a launch is `T` programs of a few KiB each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.kv_cache_dtype import cast_to_cache
from framework.layers.kernels.launch_math import next_power_of_2


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_slot_ptr,  # [T] int64: KV slot of each token, negative = padding
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    stride_c_dim,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
):
    token = tl.program_id(0)
    kv_slot = tl.load(kv_slot_ptr + token).to(tl.int64)
    if kv_slot < 0:
        return  # padding token
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + token64 * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
    # The cache viewed as [2, num_blocks * block_size, heads, dim]: a KV slot is a row of that middle axis.
    dst = cache_ptr + kv_slot * stride_c_slot + heads[:, None] * stride_c_head + dims[None, :] * stride_c_dim
    tl.store(dst, cast_to_cache(k, cache_ptr.dtype.element_ty), mask=mask)  # saturating when FP8
    tl.store(dst + stride_c_kv, cast_to_cache(v, cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T', num_kv_heads, head_dim], T' >= T; any float dtype (cast to the cache's, saturating)
    value: torch.Tensor,  # [T', num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], updated in place
    kv_slot_mapping: torch.Tensor,  # [T] int64 KV slots (block * block_size + offset), negative = padding
) -> None:
    """Write the K and V of the first `T = kv_slot_mapping.numel()` tokens into the paged cache."""
    num_tokens = kv_slot_mapping.numel()
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert key.shape[0] >= num_tokens and value.shape[0] >= num_tokens, "fewer K/V rows than KV slots"
    assert key.shape[1:] == (num_kv_heads, head_dim) and value.shape[1:] == (num_kv_heads, head_dim)
    # A KV slot indexes blocks and offsets together, which needs the two axes to be one uniform stride.
    assert kv_cache.stride(1) == block_size * kv_cache.stride(2), "cache blocks must be contiguous in tokens"
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        kv_slot_mapping,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4,
    )
