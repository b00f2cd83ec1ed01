"""Per-head q/k RMSNorm + RoPE + KV-cache store of a merged q/k/v projection, in one Triton launch.

Semantics are `qk_norm_rope_store_reference` (framework/layers/kernels/layer_ops.py): split the `[T, (H + 2 Hkv) D]`
projection into heads, RMS-normalise each q and k head when a weight is given (Qwen3), rotate by half-split
RoPE, return q `[T, H, D]` and write k and the raw v at each token's KV slot (negative = padding, skipped).
Every intermediate the reference rounds to dtype (normalised head, weight product, each RoPE product, their
sum) is rounded here too.

Grid `(cdiv(T, BLOCK_T), query head tiles + key head tiles)`: a program owns a `[BLOCK_T x TILE_HEADS, D]` tile
of query heads, or of key heads (then it also moves the matching value heads). Decode batches (up to
`ONE_HEAD_TOKENS` tokens) run one head of one token per program, the most programs; prefill batches every
query (or key) head of `BLOCK_T` tokens, about `TILE_ROWS` head vectors per program. (One head per program
throughout spent 112 us on a prefill step's 8,192 tokens at the 0.6B shapes, ~200K one-warp programs, bound by
how fast the GPU starts programs; the tiles, 61 us.) A head is handled as its two halves (RoPE pairs element
`i` with `i + D/2`), so no register shuffles are needed.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.kv_cache_dtype import cast_to_cache
from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from framework.layers.kernels.pdl import pdl_launch_kwargs
from framework.layers.kernels.triton_norm_silu import round_to_dtype

TILE_ROWS = 32  # head vectors per prefill program (tokens x heads): 16 KB of bf16 q / k at head_dim 128
ONE_HEAD_TOKENS = 128  # up to this many tokens a program holds one head (measured: faster up to 128, slower at 256)


def norm_scale_mode(unit_offset: bool, float32_scale: bool) -> int:
    """The kernels' `NORM_SCALE`: 1 for `unit_offset` ((1 + weight) in float32, Gemma 3), 2 for `float32_scale`
    (weight in float32, Gemma 4), 0 otherwise (the normalised row rounded, then times weight in dtype, as Llama)."""
    return 1 if unit_offset else 2 if float32_scale else 0


@triton.jit
def _rms_norm_halves(
    x1, x2, weight_ptr, dims, mask, eps, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, dtype, NORM_SCALE: tl.constexpr
):
    """weight * rmsnorm([x1, x2]) for heads given as their two halves along the last axis (float32 holding dtype
    values): one head `[HALF]` each, or a tile of heads `[rows, HALF]`, each row normalised on its own.
    `NORM_SCALE` (`norm_scale_mode`): 0 weight * the rounded rmsnorm in dtype (Llama); 1 (1 + weight) * rmsnorm in
    float32, rounded once (Gemma 3); 2 weight * rmsnorm in float32, rounded once (Gemma 4)."""
    rstd = tl.rsqrt(
        (tl.sum(x1 * x1, axis=-1, keep_dims=True) + tl.sum(x2 * x2, axis=-1, keep_dims=True)) / HEAD_DIM + eps
    )
    w1 = tl.load(weight_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    if NORM_SCALE == 1:
        y1 = round_to_dtype((w1 + 1.0) * (x1 * rstd), dtype)
        y2 = round_to_dtype((w2 + 1.0) * (x2 * rstd), dtype)
    elif NORM_SCALE == 2:
        y1 = round_to_dtype(w1 * (x1 * rstd), dtype)
        y2 = round_to_dtype(w2 * (x2 * rstd), dtype)
    else:
        y1 = round_to_dtype(w1 * round_to_dtype(x1 * rstd, dtype), dtype)
        y2 = round_to_dtype(w2 * round_to_dtype(x2 * rstd, dtype), dtype)
    return y1, y2


@triton.jit
def _rope_halves(x1, x2, c1, c2, s1, s2, dtype):
    """[x1, x2] * cos + [-x2, x1] * sin with each product and the sum rounded to dtype (as eager PyTorch)."""
    o1 = round_to_dtype(round_to_dtype(x1 * c1, dtype) + round_to_dtype(-x2 * s1, dtype), dtype)
    o2 = round_to_dtype(round_to_dtype(x2 * c2, dtype) + round_to_dtype(x1 * s2, dtype), dtype)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def _norm_rope_tile(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    weight_ptr,
    q_out_ptr,
    cache_ptr,
    kv_slot_ptr,
    tile,
    first_head,
    num_tokens,
    num_kv_tokens,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    eps,
    IS_KEY: tl.constexpr,  # False: query heads; True: key heads, and the value heads beside them
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    TILE_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_NORM: tl.constexpr,
    NORM_SCALE: tl.constexpr,
):
    """One program's `[BLOCK_T x TILE_HEADS, D]` tile (token-major rows: heads first_head.. of BLOCK_T tokens):
    load, norm, rope, store q or the cache's k and v."""
    dtype = q_out_ptr.dtype.element_ty
    HALF = HEAD_DIM // 2  # constexpr arithmetic stays constexpr
    dims = tl.arange(0, BLOCK_HALF)
    dim_ok = dims < HALF
    rows = tl.arange(0, BLOCK_T * TILE_HEADS)
    token = (tile * BLOCK_T + rows // TILE_HEADS).to(tl.int64)
    head = first_head + rows % TILE_HEADS
    if IS_KEY:  # tokens without a KV slot (padding, past T') store nothing
        row_ok = (token < num_tokens) & (head < NUM_KV_HEADS)
        kv_slot = tl.load(kv_slot_ptr + token, mask=row_ok & (token < num_kv_tokens), other=-1).to(tl.int64)
        row_ok = row_ok & (kv_slot >= 0)
        first_col = (NUM_HEADS + head) * HEAD_DIM  # q and k heads are adjacent
    else:
        row_ok = (token < num_tokens) & (head < NUM_HEADS)
        first_col = head * HEAD_DIM
    mask = row_ok[:, None] & dim_ok[None, :]
    src = qkv_ptr + token[:, None] * stride_qkv + first_col[:, None] + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = cos_ptr + token[:, None] * stride_cos + dims[None, :]
    sin = sin_ptr + token[:, None] * stride_sin + dims[None, :]
    c1 = tl.load(cos, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        x1, x2 = _rms_norm_halves(x1, x2, weight_ptr, dims, dim_ok, eps, HALF, HEAD_DIM, dtype, NORM_SCALE)
    y1, y2 = _rope_halves(x1, x2, c1, c2, s1, s2, dtype)
    if IS_KEY:
        # The cache viewed as [2, num_blocks * block_size, Hkv, D]: a KV slot is a row of the middle axis.
        kv_dst = cache_ptr + kv_slot[:, None] * stride_c_slot + head[:, None] * stride_c_head + dims[None, :]
        cache_dtype = cache_ptr.dtype.element_ty
        tl.store(kv_dst, cast_to_cache(y1, cache_dtype), mask=mask)
        tl.store(kv_dst + HALF, cast_to_cache(y2, cache_dtype), mask=mask)
        v_src = src + NUM_KV_HEADS * HEAD_DIM  # v head j sits Hkv heads after k head j
        v1 = tl.load(v_src, mask=mask)
        v2 = tl.load(v_src + HALF, mask=mask)
        tl.store(kv_dst + stride_c_kv, cast_to_cache(v1, cache_dtype), mask=mask)
        tl.store(kv_dst + stride_c_kv + HALF, cast_to_cache(v2, cache_dtype), mask=mask)
    else:
        q_dst = q_out_ptr + (token[:, None] * NUM_HEADS + head[:, None]) * HEAD_DIM + dims[None, :]
        tl.store(q_dst, y1, mask=mask)
        tl.store(q_dst + HALF, y2, mask=mask)


@triton.jit(do_not_specialize=["num_tokens", "num_kv_tokens"])  # per-step sizes: no recompiles mid-run
def _qk_norm_rope_store_kernel(
    qkv_ptr,  # [T, (H + 2 Hkv) * D], row stride stride_qkv: q heads, then k heads, then v heads
    cos_ptr,  # [T, D], row stride stride_cos
    sin_ptr,  # [T, D], row stride stride_sin
    q_weight_ptr,  # [D] (qkv_ptr again when HAS_Q_NORM is False; not read)
    k_weight_ptr,  # [D] (qkv_ptr again when HAS_K_NORM is False; not read)
    q_out_ptr,  # [T, H, D] contiguous
    cache_ptr,  # [2, num_blocks, block_size, Hkv, D], head_dim contiguous
    kv_slot_ptr,  # [T'] int64: KV slot of token t < T', negative = padding
    num_tokens,  # T
    num_kv_tokens,  # T'
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_TILE_HEADS: tl.constexpr,  # query heads per program (a power of two)
    KV_TILE_HEADS: tl.constexpr,  # key heads per program (a power of two)
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= HEAD_DIM // 2
    BLOCK_T: tl.constexpr,  # tokens per program
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    NORM_SCALE: tl.constexpr = 0,  # how the norms scale (`norm_scale_mode`): 0 Llama, 1 Gemma 3, 2 Gemma 4
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (framework/layers/kernels/pdl.py)
):
    if USE_PDL:  # qkv, cos / sin and the KV slots are all written by earlier kernels of the step
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    Q_TILES: tl.constexpr = (NUM_HEADS + Q_TILE_HEADS - 1) // Q_TILE_HEADS  # grid axis 1: q tiles, then k tiles
    head_tile = tl.program_id(1)
    if head_tile < Q_TILES:
        _norm_rope_tile(
            qkv_ptr,
            cos_ptr,
            sin_ptr,
            q_weight_ptr,
            q_out_ptr,
            cache_ptr,
            kv_slot_ptr,
            tl.program_id(0),
            head_tile * Q_TILE_HEADS,
            num_tokens,
            num_kv_tokens,
            stride_qkv,
            stride_cos,
            stride_sin,
            stride_c_kv,
            stride_c_slot,
            stride_c_head,
            eps,
            False,
            NUM_HEADS,
            NUM_KV_HEADS,
            Q_TILE_HEADS,
            HEAD_DIM,
            BLOCK_HALF,
            BLOCK_T,
            HAS_Q_NORM,
            NORM_SCALE,
        )
    else:
        _norm_rope_tile(
            qkv_ptr,
            cos_ptr,
            sin_ptr,
            k_weight_ptr,
            q_out_ptr,
            cache_ptr,
            kv_slot_ptr,
            tl.program_id(0),
            (head_tile - Q_TILES) * KV_TILE_HEADS,
            num_tokens,
            num_kv_tokens,
            stride_qkv,
            stride_cos,
            stride_sin,
            stride_c_kv,
            stride_c_slot,
            stride_c_head,
            eps,
            True,
            NUM_HEADS,
            NUM_KV_HEADS,
            KV_TILE_HEADS,
            HEAD_DIM,
            BLOCK_HALF,
            BLOCK_T,
            HAS_K_NORM,
            NORM_SCALE,
        )


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
    one_head: Optional[bool] = None,  # the grid: one head per program, or tiles; None: by T (ONE_HEAD_TOKENS)
    unit_offset: bool = False,  # the norms scale by (1 + weight) in float32, rounded once (Gemma 3)
    float32_scale: bool = False,  # the norms scale by weight in float32, rounded once (Gemma 4)
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
    block_half = next_power_of_2(head_dim // 2)
    if one_head is None:
        one_head = num_tokens <= ONE_HEAD_TOKENS
    if one_head:  # decode: one head of one token per program (as many programs as can be)
        block_t, q_heads, kv_heads = 1, 1, 1
    else:  # prefill: every head of BLOCK_T tokens per program (two programs per tile of tokens)
        q_heads, kv_heads = next_power_of_2(num_heads), next_power_of_2(num_kv_heads)
        block_t = max(1, TILE_ROWS // q_heads)
    head_tiles = cdiv(num_heads, q_heads) + cdiv(num_kv_heads, kv_heads)
    _qk_norm_rope_store_kernel[(cdiv(num_tokens, block_t), head_tiles)](
        qkv,
        cos,
        sin,
        q_norm_weight if q_norm_weight is not None else qkv,
        k_norm_weight if k_norm_weight is not None else qkv,
        q,
        kv_cache,
        kv_slot_mapping,
        num_tokens,
        kv_slot_mapping.numel(),
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_TILE_HEADS=q_heads,
        KV_TILE_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HALF=block_half,
        BLOCK_T=block_t,
        HAS_Q_NORM=q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None,
        NORM_SCALE=norm_scale_mode(unit_offset, float32_scale),
        num_warps=4 if block_t * q_heads * block_half >= 1024 else 1 if block_half <= 64 else 2,
        **pdl_launch_kwargs(pdl),
    )
    return q
