"""CUDA graphs of a draft head's single-token steps (drafts 2..k), one per (padded batch size, k).

The head's first pass over a step's tokens has a varying token count and runs eagerly; the k - 1 steps that
follow have one token per row, so they are captured like decode steps. Rows past the real batch are padding:
they store no KV (slot -1), start at position 0 of block table row zeros, and their drafts are dropped.
Attention grids are sized for `max_model_len` (kernels stop at each row's KV length), as in the decode graphs.
"""

from __future__ import annotations

import bisect
import logging
from typing import Optional, Protocol

import torch

logger = logging.getLogger(__name__)


class _HeadSize(Protocol):
    hidden_size: int


class SteppingDrafter(Protocol):
    """What the graphs need from a drafter (`HeadDrafter` is one); a protocol, so this module does not import it."""

    query_start_loc: torch.Tensor
    max_model_len: int

    @property
    def head(self) -> _HeadSize: ...

    def draft_steps(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        stores: torch.Tensor,
        capacity: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        k: int,
        max_seq_len: int,
    ) -> torch.Tensor: ...


class DraftStepGraphs:
    """Static inputs sized for the largest batch, and one graph per (size, k) running `HeadDrafter.draft_steps`."""

    def __init__(
        self,
        drafter: SteppingDrafter,
        batch_sizes: list[int],
        ks: list[int],
        block_size: int,
        max_blocks_per_req: int,
        dtype: torch.dtype,
    ) -> None:
        self.drafter = drafter
        self.sizes = sorted(set(batch_sizes))
        self.ks = sorted(set(ks))
        self.block_size = block_size
        device = drafter.query_start_loc.device
        n = self.sizes[-1]
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device)  # [B] draft 1
        self.hidden = torch.zeros(n, drafter.head.hidden_size, dtype=dtype, device=device)  # [B, H]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [B] last accepted position
        self.stores = torch.zeros(n, dtype=torch.bool, device=device)  # [B]
        self.capacity = torch.zeros(n, dtype=torch.int32, device=device)  # [B]
        self.block_tables = torch.zeros(n, max_blocks_per_req, dtype=torch.int32, device=device)  # [B, max_blocks]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _steps(self, size: int, k: int) -> torch.Tensor:
        return self.drafter.draft_steps(
            self.tokens[:size],
            self.hidden[:size],
            self.positions[:size],
            self.stores[:size],
            self.capacity[:size],
            self.block_tables[:size],
            self.block_size,
            k,
            self.drafter.max_model_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, k), largest size first so smaller graphs reuse its memory. Nothing is stored
        while capturing: `stores` is all False."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for k in self.ks:
                for size in reversed(self.sizes):
                    for _ in range(2):  # warm-up: Triton compilation and lazy initialisation outside the capture
                        self._steps(size, k)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        out = self._steps(size, k)
                    self.graphs[(size, k)] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured draft-step CUDA graphs for batch sizes %s and k %s", self.sizes, self.ks)

    def padded_size(self, num_rows: int, k: int) -> Optional[int]:
        """Smallest captured size holding `num_rows` for this k, or None (run eagerly)."""
        if k not in self.ks:
            return None
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self,
        size: int,
        k: int,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        stores: torch.Tensor,
        capacity: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Copy the R real rows in (padding rows reset), replay; returns drafts 2..k [R, k - 1]."""
        r = tokens.shape[0]
        self.tokens[:r].copy_(tokens)
        self.hidden[:r].copy_(hidden)
        self.positions[:r].copy_(positions)
        self.positions[r:size].zero_()
        self.stores[:r].copy_(stores)
        self.stores[r:size].fill_(False)
        self.capacity[:r].copy_(capacity)
        self.block_tables[:r].copy_(block_tables)
        self.block_tables[r:size].zero_()
        graph, out = self.graphs[(size, k)]
        graph.replay()
        return out[:r]
