"""CUDA graphs for decode batches: the model forward captured once per (padded batch size, tokens per row).

Only the forward is captured; input preparation and sampling run eagerly before and after it. A decode batch
of R rows with q tokens each (q = 1 + k when every row verifies k drafts) is padded to the smallest captured
size B >= R: padding rows get q tokens at positions 0..q-1 whose K/V stores are skipped (KV slot -1) and a
KV length of q, and their outputs are dropped. One graph exists per size for every q in `tokens_per_row`
(1 only, without speculation; 1 + k for every k a speculator may verify). Mixed batches (prefill chunks, rows
with different draft counts) and batches larger than the largest size run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Optional

import torch

from framework.attention import AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# Returns the hidden states [B, hidden], or a (possibly nested) tuple of [B, ...] tensors (e.g. with aux states).
ForwardFn = Callable[[torch.Tensor, torch.Tensor, list, AttentionMetadata], Any]


def _first_rows(out: Any, r: int) -> Any:
    """The first r rows of every tensor of a captured output (a tensor or nested tuples of tensors)."""
    if isinstance(out, torch.Tensor):
        return out[:r]
    return tuple(_first_rows(o, r) for o in out)


class DecodeCudaGraphs:
    """Static input buffers sized for the largest capture size, and one captured graph per size."""

    def __init__(
        self,
        forward: ForwardFn,
        kv_caches: list[torch.Tensor],
        capture_sizes: list[int],
        max_blocks_per_req: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        tokens_per_row: tuple[int, ...] = (1,),
    ) -> None:
        self.forward = forward
        self.kv_caches = kv_caches
        self.sizes = sorted(capture_sizes)
        self.tokens_per_row = tuple(sorted(set(tokens_per_row)))
        self.block_size = block_size
        self.max_model_len = max_model_len
        n, q_max = self.sizes[-1], self.tokens_per_row[-1]
        self.input_ids = torch.zeros(n * q_max, dtype=torch.int64, device=device)  # [B*q]
        self.positions = torch.zeros(n * q_max, dtype=torch.int64, device=device)  # [B*q]
        self._row_offsets = torch.arange(n * q_max, device=device)  # [B*q]: token index, for padding positions
        self.query_start_locs = {q: torch.arange(n + 1, dtype=torch.int32, device=device) * q  # [B+1] per q
                                 for q in self.tokens_per_row}
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [B]
        self.block_tables = torch.zeros(n, max_blocks_per_req, dtype=torch.int32, device=device)  # [B, max_blocks]
        self.kv_slot_mapping = torch.full((n * q_max,), -1, dtype=torch.int64, device=device)  # [B*q]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _metadata(self, size: int, q: int) -> AttentionMetadata:
        # max_seq_len is fixed at max_model_len: kernels size their grids from it and stop at each row's seq_len.
        return AttentionMetadata(
            num_tokens=size * q,
            num_rows=size,
            query_start_loc=self.query_start_locs[q][: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            kv_slot_mapping=self.kv_slot_mapping[: size * q],
            block_size=self.block_size,
            max_query_len=q,
            max_seq_len=self.max_model_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, q), largest first so smaller graphs reuse its memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for q in reversed(self.tokens_per_row):
                self.seq_lens.fill_(q)  # warm-up inputs: every row a valid causal row of q tokens
                for size in reversed(self.sizes):
                    meta = self._metadata(size, q)
                    args = (self.input_ids[: size * q], self.positions[: size * q], self.kv_caches, meta)
                    for _ in range(2):  # warm-up: Triton compilation and lazy initialisation happen outside capture
                        self.forward(*args)
                    graph = torch.cuda.CUDAGraph()
                    # Under tensor parallelism NCCL's watchdog thread queries events while this thread captures;
                    # "thread_local" confines the capture checks to this thread (the default would fail them).
                    mode = "thread_local" if torch.distributed.is_initialized() else "global"
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode=mode):
                        out = self.forward(*args)
                    self.graphs[(size, q)] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s x tokens per row %s", self.sizes,
                    self.tokens_per_row)

    def padded_size(self, num_rows: int, tokens_per_row: int = 1) -> Optional[int]:
        """Smallest captured size holding `num_rows` rows of `tokens_per_row` tokens, or None (run eagerly)."""
        if tokens_per_row not in self.tokens_per_row:
            return None
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> Any:
        """Copy the batch into the static buffers (padding rows reset), replay; returns the forward's output
        (hidden [R*q, hidden], or its tuple of tensors) for the real tokens."""
        r, t = meta.num_rows, meta.num_tokens
        q = t // r
        padded = size * q
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        # Padding rows: positions 0..q-1 (a valid causal row of q tokens), KV length q, stores skipped.
        torch.remainder(self._row_offsets[t:padded], q, out=self.positions[t:padded])
        self.seq_lens[:r].copy_(meta.seq_lens)
        self.seq_lens[r:size].fill_(q)
        self.block_tables[:r].copy_(meta.block_tables)
        self.block_tables[r:size].zero_()
        self.kv_slot_mapping[:t].copy_(meta.kv_slot_mapping)
        self.kv_slot_mapping[t:padded].fill_(-1)
        graph, out = self.graphs[(size, q)]
        graph.replay()
        return _first_rows(out, t)
