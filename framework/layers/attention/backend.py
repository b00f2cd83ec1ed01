"""Attention backend dispatch: Triton kernels on CUDA, the PyTorch references everywhere else.

The config key `kernels.backend`, passed down as `backend=` (framework/layers/kernels/backend.py), overrides the
choice: `reference` forces the PyTorch path (e.g. to bisect a numerical difference on a GPU), `triton` forces the
kernels (on a CPU only under `TRITON_INTERPRET=1`), `auto` (default) picks by device. Head dims the kernels do
not handle (not a power of two in 16..512: `launch_config.TRITON_HEAD_DIMS`) fall back to the reference with
one warning.

A model binds `paged_attention` to a `SplitCounters` of its own: the state the split-KV decode kernel keeps
between calls.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from framework.layers.attention.launch_config import TRITON_HEAD_DIMS
from framework.layers.attention.metadata import AttentionMetadata
from framework.layers.attention.paged import paged_attention_reference, store_kv_reference
from framework.layers.kernels.backend import kernel_backend

logger = logging.getLogger(__name__)

# Batches of at least this many rows get a launch order. At 8 KV heads (Qwen3) 64 rows are 512 programs, about
# two waves of an H200's 264 slots, unsplit (launch_config.num_kv_splits): the order decides how the last wave
# ends. At 64 rows it gained little (1.7 %, as much as batch order row by row), 7-10 % at 128-256 rows
# (docs/kernels.md); below 33 rows the keys are split, and a split launch ignores the order.
LONGEST_FIRST_MIN_ROWS = 64
_warned_head_dims: set[int] = set()


def attention_backend(device: torch.device, head_dim: int, backend: str = "auto") -> str:
    """`"triton"` or `"reference"` for tensors on `device` with this head_dim under `kernels.backend`."""
    if kernel_backend(device, backend) == "reference":
        return "reference"
    if head_dim not in TRITON_HEAD_DIMS:
        if head_dim not in _warned_head_dims:
            _warned_head_dims.add(head_dim)
            logger.warning("head_dim %d has no Triton attention kernel; using the PyTorch reference", head_dim)
        return "reference"
    return "triton"


class SplitCounters:
    """Zeroed int32 counters for the split-KV decode kernel, one buffer per device, kept for the owner's life.

    The kernel counts finished KV splits per (batch row, KV head) and the last one resets its counter, so a
    buffer zeroed once stays zero between launches: every layer, step and CUDA-graph replay reuses it. A
    buffer is allocated outside graph capture only (zeroed inside one, it would be zero only once replayed);
    an outgrown one is kept, since a captured graph may still point at it.
    """

    MIN_SLOTS = 4096  # rows x KV heads: 16 KB, more than any batch the split rule splits

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}  # [slots] int32 per device
        self._outgrown: list[torch.Tensor] = []

    def get(self, device: torch.device, num_slots: int) -> Optional[torch.Tensor]:
        """[>= num_slots] int32 zeros on `device`; None while a CUDA graph is captured and none is big enough."""
        buf = self._buffers.get(device)
        if buf is not None and buf.numel() >= num_slots:
            return buf
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # the kernel wrapper then zeroes a buffer of its own, inside the graph
        if buf is not None:
            self._outgrown.append(buf)
        buf = torch.zeros(max(num_slots, self.MIN_SLOTS), dtype=torch.int32, device=device)
        self._buffers[device] = buf
        return buf


def order_rows_longest_first(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with `row_order` = its rows by descending KV length (one small kernel, shared by every layer of
    the forward: framework/layers/attention/row_order.py), for a batch of >= `LONGEST_FIRST_MIN_ROWS` rows; else `meta`
    itself. The PyTorch reference attention ignores the order.

    The decode kernel then starts the longest rows' programs first and the shortest last, so a batch of mixed
    lengths does not end on a few long rows while the rest of the GPU idles (the order changes no result).
    """
    if meta.num_rows < LONGEST_FIRST_MIN_ROWS:
        return meta
    from framework.layers.attention.row_order import rows_longest_first  # on first use, as the Triton attention is

    return dataclasses.replace(meta, row_order=rows_longest_first(meta.seq_lens[: meta.num_rows]))


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    split_counters: Optional[SplitCounters] = None,  # None: the kernel zeroes counters per call
    pdl: bool = False,  # the kernels with programmatic dependent launch (framework/layers/kernels/pdl.py)
    out: Optional[torch.Tensor] = None,  # [T, num_heads, head_dim] to write into (rows past T untouched)
    backend: str = "auto",  # kernels.backend (framework/layers/kernels/backend.py)
    window: int = 0,  # > 0: sliding window of this many keys, the query's own included
    sinks: Optional[torch.Tensor] = None,  # [num_heads] float32: learned sink logits (gpt-oss)
) -> torch.Tensor:
    """[T, num_heads, head_dim]: causal paged attention of this step's queries (see paged.py), in `out` when
    given (prefill graph pieces read it at a fixed address: framework/runner/graphs/prefill_graphs.py)."""
    if attention_backend(query.device, query.shape[-1], backend) == "triton":
        from framework.layers.attention.triton_paged_attention import paged_attention as triton_paged_attention

        counters = None
        if split_counters is not None:
            counters = split_counters.get(query.device, meta.num_rows * kv_cache.shape[3])
        return triton_paged_attention(
            query,
            kv_cache,
            meta,
            scale,
            pdl=pdl,
            split_counters=counters,
            row_order=meta.row_order,
            out=out,
            window=window,
            sinks=sinks,
        )
    result = paged_attention_reference(query, kv_cache, meta, scale, window, sinks)
    return result if out is None else out[: result.shape[0]].copy_(result)


def store_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], updated in place
    kv_slot_mapping: torch.Tensor,  # [T] int64 KV slots, negative = padding (skipped)
    backend: str = "auto",  # kernels.backend (framework/layers/kernels/backend.py)
) -> None:
    """Write this step's K/V into the paged cache at their KV slots."""
    if attention_backend(key.device, key.shape[-1], backend) == "triton":
        from framework.layers.attention.triton_store_kv import store_kv as triton_store_kv

        triton_store_kv(key, value, kv_cache, kv_slot_mapping)
        return
    store_kv_reference(key, value, kv_cache, kv_slot_mapping)
