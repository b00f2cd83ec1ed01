"""Prompt logprobs: the logprob, rank and top-k of every prompt token after the first, computed during prefill.

Position p's hidden state predicts token p+1, so a prefill chunk covering positions [start, end) scores
prompt tokens start+1 .. min(end, prompt_len-1). The positions of all rows of a step are scored together, in
chunks of `CHUNK` positions, so the logits never exceed [CHUNK, vocab]. Values are raw (the model's
log-softmax, before any sampling parameter); the host joins the pieces across chunked-prefill steps.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Protocol

import numpy as np
import torch

from framework.params.scheduler_output import NewRequestData
from samplers.logprobs import LogprobsTensors, compute_logprobs


class PromptLogprobsPiece(NamedTuple):
    """One step's prompt logprobs: row i of `tensors` scores prompt token `start + 1 + i` of its request."""

    request_ids: list[str]
    starts: list[int]  # first scored position per request (the token scored is at start + 1)
    counts: list[int]  # positions scored per request; rows of `tensors` follow this order
    tensors: LogprobsTensors  # [N, 1+k] (k = the largest prompt_logprobs among them)


class _BatchLike(Protocol):
    request_ids: list[str]
    idx_mapping_host: np.ndarray  # [R] batch_row -> req_slot
    query_start_loc: torch.Tensor  # [R+1] int32


class PromptLogprobsState:
    """Host-side progress per req_slot: how many prompt positions were scored; nothing on the device.

    A request resumed after a preemption has already produced output, so its prompt was scored before
    (the first sampled token needs the whole prompt). Positions already in the KV cache when a request
    takes its slot would not be scored, so the scheduler never serves such a request from the prefix cache.
    """

    CHUNK = 1024

    def __init__(self, max_num_reqs: int, num_computed_host: Callable[[], np.ndarray]) -> None:
        self._num_computed_host = num_computed_host  # [S] tokens computed after this step (exact in prefill)
        self.num_top = np.full(max_num_reqs, -1, dtype=np.int64)  # -1 = no prompt logprobs
        self.prompt_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.scored = np.zeros(max_num_reqs, dtype=np.int64)  # next position to score
        self.prompt_ids: dict[int, list[int]] = {}  # host copy of the prompt of each scoring slot (the targets)

    def add_request(self, req_slot: int, new: NewRequestData) -> None:
        wanted = new.sampling_params.prompt_logprobs
        fresh = len(new.prefill_token_ids) == new.prompt_len
        self.num_top[req_slot] = wanted if (wanted is not None and fresh) else -1
        self.prompt_len[req_slot] = new.prompt_len
        self.scored[req_slot] = new.num_computed_tokens
        if self.num_top[req_slot] >= 0:
            self.prompt_ids[req_slot] = list(new.prefill_token_ids[: new.prompt_len])

    def remove_request(self, req_slot: int) -> None:
        self.num_top[req_slot] = -1
        self.prompt_ids.pop(req_slot, None)

    def apply_staged_writes(self) -> None:
        """Nothing on the device."""

    def any_in(self, req_slots: np.ndarray) -> bool:
        slots = req_slots
        return bool(((self.num_top[slots] >= 0) & (self.scored[slots] < self.prompt_len[slots] - 1)).any())

    def compute(
        self,
        batch: _BatchLike,
        hidden: torch.Tensor,  # [T, hidden]
        compute_logits: Callable[[torch.Tensor], torch.Tensor],  # [N, hidden] -> [N, V] model dtype
    ) -> Optional[PromptLogprobsPiece]:
        """Score this step's prompt positions (sizes from the host, indices built on the device)."""
        num_computed = self._num_computed_host()
        ids, starts, counts, token_index, targets = [], [], [], [], []
        num_top = 0
        for batch_row, req_slot in enumerate(batch.idx_mapping_host):
            if self.num_top[req_slot] < 0:
                continue
            start = int(self.scored[req_slot])
            end = int(num_computed[req_slot])
            stop = min(end, int(self.prompt_len[req_slot]) - 1)
            self.scored[req_slot] = end
            if stop <= start:
                continue
            n = stop - start
            # This step's tokens of the row begin at query_start_loc[row], which holds position `start`.
            token_index.append(batch.query_start_loc[batch_row].long() + torch.arange(n, device=hidden.device))
            targets.extend(self.prompt_ids[req_slot][start + 1 : stop + 1])
            ids.append(batch.request_ids[batch_row])
            starts.append(start)
            counts.append(n)
            num_top = max(num_top, int(self.num_top[req_slot]))
        if not ids:
            return None
        token_index_all = torch.cat(token_index)
        targets_all = torch.tensor(targets, dtype=torch.int64).to(hidden.device, non_blocking=True)
        pieces = []
        for lo in range(0, len(token_index_all), self.CHUNK):
            logits = compute_logits(hidden[token_index_all[lo : lo + self.CHUNK]]).float()  # [<=CHUNK, V]
            pieces.append(compute_logprobs(logits, targets_all[lo : lo + self.CHUNK], num_top))
            del logits
        tensors = LogprobsTensors(*(torch.cat(parts) for parts in zip(*pieces)))
        return PromptLogprobsPiece(ids, starts, counts, tensors)
