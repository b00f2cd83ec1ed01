"""The attention geometry the benchmarks use and the batches they time: a paged KV cache with shuffled blocks,
the step's queries and metadata; the dense K/V and the SDPA / flash-attn baseline over them."""

from __future__ import annotations

import math
import random

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
NUM_LAYERS = 28  # Qwen3-0.6B: attention launches per decode step


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    num_heads: int = NUM_HEADS,
):
    """Paged cache holding every row's keys (blocks shuffled), the step's queries and metadata."""
    from framework.layers.attention.metadata import AttentionMetadata

    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_row = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    max_blocks = max(blocks_per_row)
    num_blocks = sum(blocks_per_row)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    table = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32, device=device)
    used = 0
    for row, n in enumerate(blocks_per_row):
        table[row, :n] = perm[used : used + n]
        used += n
    cache = torch.randn(
        (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), generator=gen, device=device, dtype=torch.float32
    ).to(dtype)
    num_tokens = sum(query_lens)
    query = torch.randn((num_tokens, num_heads, HEAD_DIM), generator=gen, device=device).to(dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        num_rows=len(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table,
        kv_slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device),
        block_size=BLOCK_SIZE,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return query, cache, meta


def dense_kv(cache: torch.Tensor, meta, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, kv_heads, seq_len, D] K and V of equal-length rows, gathered out of the paged cache."""
    pos = torch.arange(seq_len, device=cache.device)
    slots = meta.block_tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE  # [B, S]
    k = cache[0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
    v = cache[1].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
    return k, v


def sdpa_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """A callable running the dense baseline, and its name. q [B, H, Q, D], k/v [B, kvH, S, D]."""
    import torch.nn.functional as F

    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]

        qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        return (lambda: flash_attn_func(qf, kf, vf, causal=causal)), "flash_attn"
    except Exception:  # noqa: BLE001 - not installed, or no build for this GPU
        pass
    try:
        F.scaled_dot_product_attention(q[:1], k[:1], v[:1], is_causal=causal, enable_gqa=True)
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)), "sdpa"
    except Exception:  # noqa: BLE001 - older torch: expand the KV heads (reads twice the bytes)
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return (lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)), "sdpa_expanded_kv"


def zero_counters(batch: int) -> torch.Tensor:
    """The split-KV counters a model keeps (framework/layers/attention/backend.py `SplitCounters`): zero, reused."""
    return torch.zeros(batch * NUM_KV_HEADS, dtype=torch.int32, device="cuda")


def mixed_decode_batch(batch: int, lo: int, hi: int, dtype: torch.dtype, num_heads: int = NUM_HEADS):
    """(query, cache, meta, GB of KV the launch must read): `batch` decode rows of lengths uniform in [lo, hi],
    the same lengths for a given batch size in every mode (seeded by it)."""
    rng = random.Random(batch)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    query, cache, meta = make_batch([1] * batch, lens, dtype, "cuda", num_heads=num_heads)
    return query, cache, meta, 2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * cache.element_size() / 1e9
