"""CUDA graphs for decode batches: the model forward captured once per (padded batch size, tokens per row).

Only the forward is captured; input preparation and sampling run eagerly before and after it. A decode batch
of R rows with q tokens each (q = 1 + k when every row verifies k drafts) is padded to the smallest captured
size B >= R: padding rows get q tokens at positions 0..q-1 whose K/V stores are skipped (KV slot -1) and a
KV length of q, and their outputs are dropped. One graph exists per size for every q in `tokens_per_row`
(1 only, without speculation; 1 + k for every k a speculator may verify). Mixed batches (prefill chunks, rows
with different draft counts) and batches larger than the largest size run eagerly.

A ModelState with per-slot forward inputs (recurrent state, cross-attention K/V) takes part through
`graph_inputs` (its `prepare_graph_inputs`): called inside the capture on the static `GraphBatch`, whose
`idx_mapping` buffer the graph fills every step (padding rows: `dummy_slot`), so the state's kernels read and
write the persistent per-slot tensors in place. How a step is captured is a `GraphCapturer`: CUDA graphs on a
GPU; tests on a CPU pass one that replays by running the captured step again on the same static buffers.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Optional, Protocol

import torch

from framework.batch.graph_batch import GraphBatch
from framework.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# Returns the hidden states [B, hidden], or a (possibly nested) tuple of [B, ...] tensors (e.g. with aux states).
ForwardFn = Callable[[torch.Tensor, torch.Tensor, list, AttentionMetadata], Any]


# The state's extra forward inputs inside a graph, from the graph's static buffers (ModelState.prepare_graph_inputs).
GraphInputsFn = Callable[[GraphBatch], dict]


class Replayable(Protocol):
    """One captured step: `replay()` runs it again on the current contents of the static buffers;
    `num_replays` counts the replays (which captured sizes and variants a workload actually uses)."""

    num_replays: int

    def replay(self) -> Any: ...


class GraphCapturer(Protocol):
    """Turns a step (a callable reading only static buffers) into something that replays it."""

    def capture(self, step: Callable[[], Any]) -> Replayable: ...

    def finish(self) -> None: ...


class _CudaReplay:
    def __init__(self, graph: torch.cuda.CUDAGraph, out: Any) -> None:
        self.graph, self.out = graph, out
        self.num_replays = 0

    def replay(self) -> Any:
        self.num_replays += 1
        self.graph.replay()
        return self.out  # the captured output tensors, refilled by the replay


class CudaGraphCapturer:
    """CUDA graphs sharing one memory pool, captured on a side stream (capture the largest first)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def capture(self, step: Callable[[], Any]) -> Replayable:
        self.stream.wait_stream(torch.cuda.current_stream())  # the static buffers were filled on it
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm-up: Triton compilation and lazy initialisation happen outside capture
                step()
            graph = torch.cuda.CUDAGraph()
            # Under tensor parallelism NCCL's watchdog thread queries events while this thread captures;
            # "thread_local" confines the capture checks to this thread (the default would fail them).
            mode = "thread_local" if torch.distributed.is_initialized() else "global"
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode=mode):
                out = step()
        return _CudaReplay(graph, out)

    def finish(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()


def capture_sizes(configured: "list[int] | tuple[int, ...]", max_reqs: int) -> list[int]:
    """The batch sizes to capture: the configured ones up to `max_reqs`, plus `max_reqs` itself (up to 512) so a
    full batch replays too."""
    return sorted({s for s in configured if s <= max_reqs} | ({max_reqs} if max_reqs <= 512 else set()))


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
        graph_inputs: Optional[GraphInputsFn] = None,
        dummy_slot: int = 0,
        capturer: Optional[GraphCapturer] = None,
    ) -> None:
        self.forward = forward
        self.graph_inputs = graph_inputs
        self.dummy_slot = dummy_slot
        self._capturer: GraphCapturer = capturer if capturer is not None else CudaGraphCapturer()
        self.pool = getattr(self._capturer, "pool", None)  # the CUDA graphs' shared memory pool
        self.kv_caches = kv_caches
        self.sizes = sorted(capture_sizes)
        self.tokens_per_row = tuple(sorted(set(tokens_per_row)))
        self.block_size = block_size
        self.max_model_len = max_model_len
        n, q_max = self.sizes[-1], self.tokens_per_row[-1]
        self.input_ids = torch.zeros(n * q_max, dtype=torch.int64, device=device)  # [B*q]
        self.positions = torch.zeros(n * q_max, dtype=torch.int64, device=device)  # [B*q]
        self._row_offsets = torch.arange(n * q_max, device=device)  # [B*q]: token index, for padding positions
        self.query_start_locs = {
            q: torch.arange(n + 1, dtype=torch.int32, device=device) * q  # [B+1] per q
            for q in self.tokens_per_row
        }
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [B]
        self.block_tables = torch.zeros(n, max_blocks_per_req, dtype=torch.int32, device=device)  # [B, max_blocks]
        self.kv_slot_mapping = torch.full((n * q_max,), -1, dtype=torch.int64, device=device)  # [B*q]
        # [B] batch_row -> req_slot, for states with per-slot inputs; padding rows (and warm-up) hit dummy_slot.
        self.idx_mapping = torch.full((n,), dummy_slot, dtype=torch.int32, device=device)
        self.token_rows = {q: torch.arange(n * q, device=device) // q for q in self.tokens_per_row}  # [B*q] per q
        self.graphs: dict[tuple[int, int], Replayable] = {}

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

    def graph_batch(self, size: int, q: int) -> GraphBatch:
        """The static buffers a graph of `size` rows x `q` tokens reads (views: same addresses every step)."""
        return GraphBatch(
            size, q, self.idx_mapping[:size], self.query_start_locs[q][: size + 1], self.token_rows[q][: size * q]
        )

    def _step(self, size: int, q: int) -> Callable[[], Any]:
        args = (self.input_ids[: size * q], self.positions[: size * q], self.kv_caches, self._metadata(size, q))
        graph_inputs, batch = self.graph_inputs, self.graph_batch(size, q)
        if graph_inputs is None:
            return lambda: self.forward(*args)
        return lambda: self.forward(*args, **graph_inputs(batch))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, q), largest first so smaller graphs reuse its memory pool."""
        capturer = self._capturer
        for q in reversed(self.tokens_per_row):
            self.seq_lens.fill_(q)  # warm-up inputs: every row a valid causal row of q tokens
            for size in reversed(self.sizes):
                self.graphs[(size, q)] = capturer.capture(self._step(size, q))
        capturer.finish()
        logger.info(
            "captured CUDA graphs for decode batch sizes %s x tokens per row %s", self.sizes, self.tokens_per_row
        )

    def padded_size(self, num_rows: int, tokens_per_row: int = 1) -> Optional[int]:
        """Smallest captured size holding `num_rows` rows of `tokens_per_row` tokens, or None (run eagerly)."""
        if tokens_per_row not in self.tokens_per_row:
            return None
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        idx_mapping: Optional[torch.Tensor] = None,
    ) -> Any:
        """Copy the batch into the static buffers (padding rows reset), replay; returns the forward's output
        (hidden [R*q, hidden], or its tuple of tensors) for the real tokens. `idx_mapping` [R] int32
        (batch_row -> req_slot) is needed when the graphs have `graph_inputs`."""
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
        if self.graph_inputs is not None:
            if idx_mapping is None:
                raise ValueError("these decode graphs read per-slot state: run() needs the batch's idx_mapping")
            self.idx_mapping[:r].copy_(idx_mapping)
            self.idx_mapping[r:size].fill_(self.dummy_slot)
        return _first_rows(self.graphs[(size, q)].replay(), t)
