"""This step's batch: small per-row arrays built on the host, everything per-token built on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from framework.batch.host_staging import InputStaging
from framework.batch.request_state import RequestState
from framework.layers.kernels.input_prep import prepare_inputs
from framework.params.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class InputBatch:
    """One step's inputs. Host arrays are per batch row; device tensors say their index space."""

    request_ids: list[str]  # batch_row -> request id
    num_rows: int  # R
    num_tokens: int  # T
    num_logits: int  # L = R + total drafts
    max_query_len: int
    max_seq_len: int
    idx_mapping_host: np.ndarray  # [R] int64: batch_row -> req_slot
    num_draft_host: np.ndarray  # [R] int64
    idx_mapping: torch.Tensor  # [R] int32: batch_row -> req_slot
    query_start_loc: torch.Tensor  # [R+1] int32: first token of each row
    query_lens: torch.Tensor  # [R] int32
    num_draft: torch.Tensor  # [R] int32: drafts verified per row
    cu_num_logits: torch.Tensor  # [R+1] int32: first logits row of each row
    token_rows: torch.Tensor  # [T] int64: token -> batch_row
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [R] int32: KV length after this step
    logits_indices: torch.Tensor  # [L] int64: logits_row -> token
    expanded_idx_mapping: torch.Tensor  # [L] int32: logits_row -> req_slot
    sample_positions: torch.Tensor  # [L] int64: position of the token each logits row samples


def _prefix_sum(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=out[1:])
    return out


def batch_req_slots(output: SchedulerOutput, state: RequestState) -> np.ndarray:
    """[R] int64: batch_row -> req_slot of this step's rows (host only)."""
    ids = output.scheduled_request_ids
    return np.fromiter(map(state.req_id_to_slot.__getitem__, ids), dtype=np.int64, count=len(ids))


def advance_num_computed_host(
    output: SchedulerOutput, state: RequestState, slots: np.ndarray, num_scheduled: np.ndarray
) -> np.ndarray:
    """Move the host mirror of computed tokens past this step; returns the rows' seq_lens [R] int64 (host)."""
    if output.num_computed_tokens is not None:  # the scheduler's count, corrected for rejected drafts
        state.num_computed_host[slots] = output.num_computed_tokens
    seq_lens_host = state.num_computed_host[slots] + num_scheduled
    state.num_computed_host[slots] = seq_lens_host
    return seq_lens_host


# The per-row arrays a step sends to the device, in the order `build_input_batch` packs them.
NUM_STAGED_PIECES = 5  # idx_mapping [R], query_start_loc [R+1], cu_num_logits [R+1], query_lens [R], num_draft [R]


def input_staging(max_rows: int, device: torch.device, num_buffers: int = 3, pin: bool = True) -> InputStaging:
    """The staging buffers `build_input_batch` sends steps of at most `max_rows` rows through (`num_buffers`
    steps in flight at once; pinned on a GPU unless `pin` is False)."""
    return InputStaging(InputStaging.capacity_for(max_rows, NUM_STAGED_PIECES), device, num_buffers, pin=pin)


def build_input_batch(
    output: SchedulerOutput,
    state: RequestState,
    device: torch.device,
    staging: Optional[InputStaging] = None,
    slots: Optional[np.ndarray] = None,
) -> InputBatch:
    """Host: idx_mapping and prefix sums (O(rows)), sent in one copy through `staging` (the runner's; by default
    buffers sized for this step). Device: tokens, positions, logits rows (O(tokens)). `slots`: this step's
    `batch_req_slots`, when the caller has them already."""
    if slots is None:
        slots = batch_req_slots(output, state)
    num_scheduled = np.asarray(output.num_scheduled_tokens, dtype=np.int64)
    num_draft = np.asarray(output.num_draft_tokens, dtype=np.int64)
    query_start_loc = _prefix_sum(num_scheduled)
    cu_num_logits = _prefix_sum(num_draft + 1)
    seq_lens_host = advance_num_computed_host(output, state, slots, num_scheduled)
    num_tokens, num_logits = int(query_start_loc[-1]), int(cu_num_logits[-1])

    if staging is None:
        staging = input_staging(len(slots), device, num_buffers=1, pin=False)  # used once: pageable, no fence
    idx_mapping, qsl, cu_logits, query_lens, num_draft_dev = staging.send(  # one H2D copy (NUM_STAGED_PIECES)
        (slots, query_start_loc, cu_num_logits, num_scheduled, num_draft)
    )
    prepared, token_rows = prepare_inputs(
        idx_mapping,
        qsl,
        cu_logits,
        num_tokens,
        num_logits,
        state.all_token_ids,
        state.prefill_len,
        state.num_computed,
        state.last_sampled,
        state.draft_tokens,
        int(num_draft.max()) + 1,
    )
    return InputBatch(
        request_ids=list(output.scheduled_request_ids),
        num_rows=len(slots),
        num_tokens=num_tokens,
        num_logits=num_logits,
        max_query_len=int(num_scheduled.max()),
        max_seq_len=int(seq_lens_host.max()),
        idx_mapping_host=slots,
        num_draft_host=num_draft,
        idx_mapping=idx_mapping,
        query_start_loc=qsl,
        query_lens=query_lens,
        num_draft=num_draft_dev,
        cu_num_logits=cu_logits,
        token_rows=token_rows,
        **prepared._asdict(),
    )
