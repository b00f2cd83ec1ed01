"""Device-to-host copy of one step's results, started on a side stream before the post-update.

Sampled tokens, their logprobs, per-row errors and prompt logprobs all travel here; `AsyncOutput.get()` is
the one place where the host waits for the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import torch

if TYPE_CHECKING:
    from framework.runner.pooling import PooledRows
    from samplers.logprobs import LogprobsTensors
    from samplers.prompt_logprobs import PromptLogprobsPiece


class LogprobsLists(NamedTuple):
    """Host copy of logprobs for consecutive tokens: entry i is column 0 = chosen token, then the top-k."""

    token_ids: list[list[int]]  # n lists of 1+k
    logprobs: list[list[float]]  # n lists of 1+k
    ranks: list[int]  # [n]: rank of the chosen token


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per batch row: the tokens the request produced this step (empty for a prefill chunk), and extras."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: Optional[list[Optional[LogprobsLists]]] = None  # per batch row, one entry per sampled token
    errors: Optional[list[int]] = None  # per batch row: 0, or a samplers.sampler ROW_* error code
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)  # id -> (start, lists)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # embedding request id -> its vector


def landing_view(buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first prod(shape) elements of the flat pinned `buffer`, viewed as `shape`.

    The view is contiguous whatever the shape: a non_blocking copy into a strided slice of pinned memory
    (`buffer2d[:rows, :width]` with width < the buffer's) is not asynchronous; PyTorch stages it and the host
    waits for the device, which cost speculating engines a full step per step whenever k < K.
    """
    n = math.prod(shape)
    assert buffer.dim() == 1 and buffer.numel() >= n, f"landing buffer of {buffer.numel()} elements for {shape}"
    return buffer[:n].view(shape)


class AsyncOutput:
    """Holds a step's results while they travel to the host; `get()` waits only for that copy.

    On a GPU the copy runs on `copy_stream` after the main stream reaches this point, into pinned memory,
    so the main stream goes on with the post-update and draft proposal. On the CPU the tensors are read as is.
    """

    def __init__(
        self,
        request_ids: list[str],
        sampled: torch.Tensor,  # [R, K+1] int64
        num_sampled: torch.Tensor,  # [R] int32
        copy_stream: Optional[torch.cuda.Stream] = None,
        host_buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # pinned flat [>=R*(K+1)], [>=R]
        *,
        logprobs: Optional["LogprobsTensors"] = None,  # [L, 1+k] per logits row
        logits_row_starts: Optional[Sequence[int]] = None,  # [R] first logits row of each batch row
        errors: Optional[torch.Tensor] = None,  # [R] int32
        prompt_logprobs: Optional["PromptLogprobsPiece"] = None,
        pooled: Optional["PooledRows"] = None,  # vectors of embedding requests whose prompt completed
    ) -> None:
        self.request_ids = request_ids
        self._logits_row_starts = logits_row_starts  # read (as a list) only when logprobs come back
        self._prompt_meta = prompt_logprobs
        self._pooled_meta = pooled
        tensors: dict[str, torch.Tensor] = {"sampled": sampled, "num_sampled": num_sampled}
        if logprobs is not None:
            tensors.update(lp_ids=logprobs.token_ids, lp_values=logprobs.logprobs, lp_ranks=logprobs.ranks)
        if errors is not None:
            tensors["errors"] = errors
        if prompt_logprobs is not None:
            t = prompt_logprobs.tensors
            tensors.update(plp_ids=t.token_ids, plp_values=t.logprobs, plp_ranks=t.ranks)
        if pooled is not None:
            tensors["pooled"] = pooled.vectors
        self._event: Optional[torch.cuda.Event] = None
        self._sampled: Optional[list[list[int]]] = None
        if copy_stream is None:
            self._host = tensors
            return
        main = torch.cuda.current_stream()
        self._host = {}
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(main)
            if host_buffers is not None:  # reused landing buffers for the tokens (the runner rotates them)
                self._host["sampled"] = landing_view(host_buffers[0], tuple(sampled.shape))
                self._host["num_sampled"] = landing_view(host_buffers[1], tuple(num_sampled.shape))
            for name, tensor in tensors.items():
                if name not in self._host:
                    self._host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._host[name].copy_(tensor, non_blocking=True)
                tensor.record_stream(copy_stream)
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)

    @classmethod
    def empty(cls) -> "AsyncOutput":
        return cls([], torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int32))

    def sampled_token_ids(self) -> list[list[int]]:
        """Wait for the copy (GPU); per batch row, the tokens it produced. Cached: the runner's grammar matchers
        (structured outputs) read them before the engine does."""
        if self._sampled is None:
            if self._event is not None:
                self._event.synchronize()
            counts, rows = self._host["num_sampled"].tolist(), self._host["sampled"].tolist()
            width = len(rows[0]) if rows else 0
            # The common step (no drafts, every row samples its one token) needs no per-row slice.
            if not (counts and min(counts) == width):
                rows = [row[:n] for row, n in zip(rows, counts)]
            self._sampled = rows
        return self._sampled

    def get(self) -> ModelRunnerOutput:
        """Wait for the copy (GPU) and return plain Python lists."""
        sampled = self.sampled_token_ids()
        h = self._host
        logprobs = None
        if "lp_ids" in h:
            counts = [len(row) for row in sampled]
            ids, values, ranks = h["lp_ids"].tolist(), h["lp_values"].tolist(), h["lp_ranks"].tolist()
            starts = list(self._logits_row_starts) if self._logits_row_starts is not None else list(range(len(sampled)))
            logprobs = [
                LogprobsLists(ids[s : s + n], values[s : s + n], ranks[s : s + n]) if n else None
                for s, n in zip(starts, counts)
            ]
        prompt: dict[str, tuple[int, LogprobsLists]] = {}
        if self._prompt_meta is not None:
            ids, values, ranks = h["plp_ids"].tolist(), h["plp_values"].tolist(), h["plp_ranks"].tolist()
            offset = 0
            meta = self._prompt_meta
            for request_id, start, n in zip(meta.request_ids, meta.starts, meta.counts):
                sl = slice(offset, offset + n)
                prompt[request_id] = (start, LogprobsLists(ids[sl], values[sl], ranks[sl]))
                offset += n
        errors = h["errors"].tolist() if "errors" in h else None
        pooled: dict[str, list[float]] = {}
        if self._pooled_meta is not None:
            vectors = h["pooled"].tolist()
            for request_id, vector, dims in zip(self._pooled_meta.request_ids, vectors, self._pooled_meta.dimensions):
                pooled[request_id] = vector[:dims]
        return ModelRunnerOutput(self.request_ids, sampled, logprobs, errors, prompt, pooled)
