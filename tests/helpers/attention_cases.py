"""Random paged-attention batches for the Triton-vs-reference tests (CPU interpreter and GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.layers.attention.metadata import AttentionMetadata
from framework.layers.attention.paged import store_kv_reference


@dataclass
class PagedCase:
    query: torch.Tensor  # [T_padded, num_heads, head_dim]
    key: torch.Tensor  # [T_padded, num_kv_heads, head_dim]: this step's new keys
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], cached prefixes stored
    meta: AttentionMetadata
    num_real_tokens: int  # query_start_loc[R]; tokens past it are padding


def make_paged_case(
    rows: list[tuple[int, int]],  # (cached context_len, query_len) per batch row
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    num_pad_tokens: int = 0,
    seed: int = 0,
    poison: bool = True,
    cache_dtype: torch.dtype | None = None,  # the KV cache's element type (an FP8 one); default dtype
) -> PagedCase:
    """A batch whose rows own blocks in shuffled physical order; unused cache memory holds NaN (`poison`).

    The cached prefix of every row is already in the cache; this step's new K/V are returned separately
    (`key`, `value`) with their KV slots in `meta.kv_slot_mapping` (padding tokens get slot -1).
    """
    cpu_gen = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [c + q for c, q in rows]
    blocks_per_row = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(1, max(blocks_per_row)) + 1  # one spare column: never read
    num_blocks = sum(blocks_per_row) + 3
    perm = torch.randperm(num_blocks, generator=cpu_gen)
    spare = int(perm[-1])  # table padding points at a block nobody writes
    table = torch.full((len(rows), max_blocks), spare, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_row):
        table[r, :n] = perm[used : used + n]
        used += n

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    fill = float("nan") if poison else 0.0
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=cache_dtype or dtype, device=device
    )
    num_tokens = sum(q for _, q in rows)
    qsl = [0]
    for _, q in rows:
        qsl.append(qsl[-1] + q)
    t_pad = num_tokens + num_pad_tokens
    query, key, value = (
        randn(t_pad, num_heads, head_dim),
        randn(t_pad, num_kv_heads, head_dim),
        randn(t_pad, num_kv_heads, head_dim),
    )
    table_dev = table.to(device)
    old_rows = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([c for c, _ in rows]))
    old_pos = torch.cat([torch.arange(c) for c, _ in rows] + [torch.zeros(0, dtype=torch.long)])
    new_rows = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([q for _, q in rows]))
    new_pos = torch.cat([torch.arange(c, c + q) for c, q in rows] + [torch.zeros(0, dtype=torch.long)])

    def kv_slots(rows_: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return table[rows_, pos // block_size].long() * block_size + pos % block_size

    if old_pos.numel():  # the cached prefixes, written by earlier steps
        store_kv_reference(
            randn(old_pos.numel(), num_kv_heads, head_dim),
            randn(old_pos.numel(), num_kv_heads, head_dim),
            cache,
            kv_slots(old_rows, old_pos).to(device),
        )
    kv_slot_mapping = torch.cat([kv_slots(new_rows, new_pos), torch.full((num_pad_tokens,), -1, dtype=torch.long)])
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        num_rows=len(rows),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table_dev,
        kv_slot_mapping=kv_slot_mapping.to(device),
        block_size=block_size,
        max_query_len=max((q for _, q in rows), default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return PagedCase(query, key, value, cache, meta, num_tokens)
