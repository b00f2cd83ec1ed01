"""Per-slot pooling state: prompt hidden states become one vector per pooling request, on the device.

Hidden states are pooled as prefill chunks arrive (chunked prefill keeps nothing but a running sum and
count, or the first token's state); when a request's prompt completes, its vector is finished (truncated to
`dimensions`, L2-normalised) and handed to the async output copy. Which rows complete is known on the host
(prompt lengths and computed-token counts are host numbers), so nothing here waits for the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import numpy as np
import torch

from framework.batch.input_batch import InputBatch
from framework.params.scheduler_output import NewRequestData

if TYPE_CHECKING:
    from framework.models.loaded import LoadedModel

_KIND_CODES = {"last": 0, "mean": 1, "cls": 2}


def hidden_size_of(loaded: "LoadedModel") -> int:
    """Width of the hidden states the model's `forward` returns (what embeddings are made of)."""
    cfg = loaded.hf_config
    return int(cfg.get("hidden_size") or cfg.get("d_model") or 0)


class PooledRows(NamedTuple):
    """Vectors of the pooling requests whose prompt completed this step."""

    request_ids: list[str]
    vectors: torch.Tensor  # [N, hidden] float32 on the device; columns >= dimensions[i] are zero
    dimensions: list[int]  # [N] host: how many leading values of each vector to keep


class PoolingState:
    """Owns, per req_slot, the pooling type and parameters and the running sum / count / first hidden state.

    Same verbs as every per-slot owner: `add_request`, `remove_request`, `apply_staged_writes`, `apply`.
    A reused (or re-added after preemption) slot is reset by `add_request` + `apply_staged_writes`.
    """

    def __init__(self, max_num_reqs: int, hidden_size: int, device: torch.device) -> None:
        self.device = device
        self.hidden_size = hidden_size
        self.sums = torch.zeros(max_num_reqs, hidden_size, dtype=torch.float32, device=device)  # [S, H]
        self.counts = torch.zeros(max_num_reqs, dtype=torch.float32, device=device)  # [S] tokens summed
        self.first = torch.zeros(max_num_reqs, hidden_size, dtype=torch.float32, device=device)  # [S, H] CLS
        # Host, per req_slot: pooling kind code (-1 = a generation request), prompt length, parameters.
        self.kind = np.full(max_num_reqs, -1, dtype=np.int64)
        self.prompt_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.normalize = np.zeros(max_num_reqs, dtype=bool)
        self.dimensions = np.zeros(max_num_reqs, dtype=np.int64)
        self._to_reset: list[int] = []
        self._num_pooling = 0  # slots holding an embedding request (0: the per-step checks return at once)

    def add_request(self, req_slot: int, new: NewRequestData) -> None:
        params = new.pooling_params
        self._num_pooling -= int(self.kind[req_slot] >= 0)  # a slot re-added without a remove
        if params is None:
            self.kind[req_slot] = -1
            return
        self._num_pooling += 1
        self.kind[req_slot] = _KIND_CODES[params.pooling_type or "last"]
        self.prompt_len[req_slot] = new.prompt_len
        self.normalize[req_slot] = params.normalize
        self.dimensions[req_slot] = params.dimensions or self.hidden_size
        self._to_reset.append(req_slot)

    def remove_request(self, req_slot: int) -> None:
        self._num_pooling -= int(self.kind[req_slot] >= 0)
        self.kind[req_slot] = -1

    def only_pooling(self, idx_mapping_host: np.ndarray) -> bool:
        """True when every batch row (req_slots `idx_mapping_host`) is an embedding request: nothing to sample."""
        if self._num_pooling == 0:
            return False  # a batch has at least one row: with no embedding request it has a generation row
        return bool((self.kind[idx_mapping_host] >= 0).all())

    def any_in(self, idx_mapping_host: np.ndarray) -> bool:
        """True when some batch row (req_slots `idx_mapping_host`) is an embedding request."""
        return bool((self.kind[idx_mapping_host] >= 0).any())

    def apply_staged_writes(self) -> None:
        """Zero the running sums of slots that (re)started a pooling prompt: one scatter per tensor."""
        if not self._to_reset:
            return
        slots = torch.tensor(self._to_reset, dtype=torch.int64).to(self.device, non_blocking=True)
        self.sums.index_fill_(0, slots, 0.0)
        self.counts.index_fill_(0, slots, 0.0)
        self.first.index_fill_(0, slots, 0.0)
        self._to_reset.clear()

    def apply(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,  # [T, hidden]: the model's output (after the final norm)
        num_scheduled: Sequence[int],  # [R] host: tokens of each batch row this step
        seq_lens: np.ndarray,  # [R] host: computed tokens of each batch row after this step
    ) -> Optional[PooledRows]:
        """Fold this step's prompt tokens into the pooling rows' state; finish the rows whose prompt is done."""
        if self._num_pooling == 0:
            return None  # no embedding request holds a slot (the common step)
        kinds = self.kind[batch.idx_mapping_host]  # [R]
        if not (kinds >= 0).any():
            return None
        num_scheduled = np.asarray(num_scheduled)
        query_start = np.concatenate([[0], np.cumsum(num_scheduled)])  # [R+1] host
        slots = batch.idx_mapping.long()  # [R] req_slot
        if (kinds == _KIND_CODES["mean"]).any():
            row_is_mean = torch.from_numpy(kinds == _KIND_CODES["mean"]).to(self.device, non_blocking=True)  # [R]
            token_weight = row_is_mean[batch.token_rows].to(torch.float32)  # [T]
            self.sums.index_add_(0, slots[batch.token_rows], hidden.float() * token_weight[:, None])
            self.counts.index_add_(0, slots, batch.query_lens.float() * row_is_mean)
        starts = seq_lens - num_scheduled
        cls_rows = np.flatnonzero((kinds == _KIND_CODES["cls"]) & (starts == 0))
        if len(cls_rows):  # the chunk holding position 0
            self.first[self._dev(batch.idx_mapping_host[cls_rows])] = hidden[self._dev(query_start[cls_rows])].float()
        done = np.flatnonzero((kinds >= 0) & (seq_lens >= self.prompt_len[batch.idx_mapping_host]))
        if not len(done):
            return None
        done_slots_host = batch.idx_mapping_host[done]
        done_slots = self._dev(done_slots_host)
        last = hidden[self._dev(query_start[done + 1] - 1)].float()  # [N, H]
        mean = self.sums[done_slots] / self.counts[done_slots].clamp(min=1.0)[:, None]
        kind = self._dev(kinds[done])[:, None]
        vectors = torch.where(
            kind == _KIND_CODES["mean"], mean, torch.where(kind == _KIND_CODES["cls"], self.first[done_slots], last)
        )
        return PooledRows(
            [batch.request_ids[r] for r in done],
            *self._finish(vectors, self.dimensions[done_slots_host], self.normalize[done_slots_host]),
        )

    def _finish(
        self, vectors: torch.Tensor, dimensions: np.ndarray, normalize: np.ndarray
    ) -> tuple[torch.Tensor, list[int]]:
        """Truncate to `dimensions` (zero the rest), then L2-normalise the rows that ask for it."""
        columns = torch.arange(self.hidden_size, device=self.device)
        vectors = vectors * (columns[None, :] < self._dev(dimensions)[:, None])
        if normalize.any():
            norms = vectors.norm(dim=1, keepdim=True).clamp(min=1e-12)
            vectors = torch.where(self._dev(normalize)[:, None], vectors / norms, vectors)
        return vectors, dimensions.tolist()

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)
