"""V1's persistent batch: one row per request, and the rows move with the batch.

Unlike V2's stable request slots, a row here is both the request's long-lived state and its place in this
step's batch. When a request leaves, its row becomes a hole; new requests fill holes first, `condense`
moves the last rows into the remaining holes, and `reorder` swaps rows until rows 0..R-1 are this step's
scheduled requests in the scheduler's order. Every per-row array moves together (`row_arrays` lists them).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from framework.params.scheduler_output import NewRequestData


class PersistentBatch:
    """Per-row host arrays of the requests in the batch (NumPy, CPU).

    Rows `0 .. num_rows-1` hold requests or holes; after `condense` there are no holes. Per row:
    `token_ids` (prefill tokens then every sampled token; `num_tokens` valid), `prompt_len`, `prefill_len`,
    `num_computed` (tokens whose KV is cached), `block_table` (`num_blocks` valid) and `state_slot` (the
    stable slot of the request, see `ModelRunnerV1`: its ModelState and sampling parameters live there).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.req_ids: list[Optional[str]] = [None] * max_num_reqs  # row -> request id (None = hole)
        self.req_id_to_row: dict[str, int] = {}
        self.num_rows = 0  # rows in use, holes included
        self._holes: list[int] = []
        self.num_moves = 0  # rows moved into holes by condense (counted for tests and benchmarks)
        self.num_swaps = 0  # row swaps made by reorder

        def rows(dtype: type, *shape: int) -> np.ndarray:
            return np.zeros((max_num_reqs, *shape), dtype=dtype)

        self.token_ids = rows(np.int32, max_model_len)  # [rows, max_model_len]
        self.num_tokens = rows(np.int64)
        self.prompt_len = rows(np.int64)
        self.prefill_len = rows(np.int64)
        self.num_computed = rows(np.int64)
        self.block_table = rows(np.int32, max_blocks_per_req)  # [rows, max_blocks] KV block ids
        self.num_blocks = rows(np.int64)
        self.state_slot = rows(np.int64)

    def row_arrays(self) -> dict[str, np.ndarray]:
        """Every per-row array, by name: what a move or swap must carry."""
        names = (
            "token_ids",
            "num_tokens",
            "prompt_len",
            "prefill_len",
            "num_computed",
            "block_table",
            "num_blocks",
            "state_slot",
        )
        return {name: getattr(self, name) for name in names}

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    # ---- requests in and out -------------------------------------------------------------------------
    def add_request(self, new: NewRequestData, state_slot: int) -> int:
        """Write the request into the lowest hole, or a new row at the end; returns the row."""
        if new.request_id in self.req_id_to_row:
            raise RuntimeError(f"request '{new.request_id}' is already in row {self.req_id_to_row[new.request_id]}")
        if self._holes:
            row = min(self._holes)
            self._holes.remove(row)
        elif self.num_rows < self.max_num_reqs:
            row = self.num_rows
            self.num_rows += 1
        else:
            raise RuntimeError(f"the persistent batch is full (max_num_reqs={self.max_num_reqs})")
        self.req_ids[row] = new.request_id
        self.req_id_to_row[new.request_id] = row
        n = len(new.prefill_token_ids)
        self.token_ids[row, :n] = new.prefill_token_ids
        self.num_tokens[row] = n
        self.prompt_len[row] = new.prompt_len
        self.prefill_len[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self.state_slot[row] = state_slot
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        if start + len(block_ids) > self.max_blocks_per_req:
            raise RuntimeError(f"row {row} would hold more than {self.max_blocks_per_req} blocks")
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove_request(self, request_id: str) -> Optional[int]:
        """Turn the request's row into a hole; returns its `state_slot` (None if it has no row)."""
        row = self.req_id_to_row.pop(request_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self._holes.append(row)
        return int(self.state_slot[row])

    # ---- rows move -----------------------------------------------------------------------------------
    def condense(self) -> None:
        """Move the last rows into the holes, so that rows 0..num_reqs-1 hold every request."""
        last = self.num_rows - 1
        for hole in sorted(self._holes):
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move(last, hole)
            last -= 1
        self._holes.clear()
        self.num_rows = self.num_reqs

    def reorder(self, request_ids: list[str]) -> None:
        """Swap rows until row i holds `request_ids[i]` (the scheduler's order); others follow them."""
        for row, request_id in enumerate(request_ids):
            current = self.req_id_to_row[request_id]
            if current != row:
                self._swap(row, current)

    def _move(self, src: int, dst: int) -> None:
        """Row `src` (a request) moves into the hole `dst`; only the valid prefix of 2-D rows is copied."""
        for name, array in self.row_arrays().items():
            if name == "token_ids":
                n = int(self.num_tokens[src])
                array[dst, :n] = array[src, :n]
            elif name == "block_table":
                n = int(self.num_blocks[src])
                array[dst, :n] = array[src, :n]
            else:
                array[dst] = array[src]
        request_id = self.req_ids[src]
        assert request_id is not None
        self.req_ids[dst], self.req_ids[src] = request_id, None
        self.req_id_to_row[request_id] = dst
        self.num_moves += 1

    def _swap(self, a: int, b: int) -> None:
        """Exchange rows `a` and `b` (either may be a hole) in every per-row array."""
        pair, flipped = [a, b], [b, a]
        token_cols = int(max(self.num_tokens[a], self.num_tokens[b]))
        block_cols = int(max(self.num_blocks[a], self.num_blocks[b]))
        for name, array in self.row_arrays().items():
            if name == "token_ids":
                array[pair, :token_cols] = array[flipped, :token_cols]
            elif name == "block_table":
                array[pair, :block_cols] = array[flipped, :block_cols]
            else:
                array[pair] = array[flipped]
        self.req_ids[a], self.req_ids[b] = self.req_ids[b], self.req_ids[a]
        for row in pair:
            if self.req_ids[row] is not None:
                self.req_id_to_row[self.req_ids[row]] = row  # type: ignore[index]
        self.num_swaps += 1

    # ---- after sampling ------------------------------------------------------------------------------
    def append_sampled(self, seq_lens: np.ndarray, sampled: np.ndarray) -> np.ndarray:
        """Rows 0..R-1: append each row's sampled token if its prefill is complete; returns [R] num_sampled.

        seq_lens: [R] KV length of each row after this step. sampled: [R] one token per row. A prefill chunk
        that ends before `prefill_len` samples nothing (its token is dropped).
        """
        num_rows = len(seq_lens)
        done = seq_lens >= self.prefill_len[:num_rows]
        rows = np.flatnonzero(done & (self.num_tokens[:num_rows] < self.max_model_len))
        self.token_ids[rows, self.num_tokens[rows]] = sampled[rows]
        self.num_tokens[rows] += 1
        return done.astype(np.int32)
