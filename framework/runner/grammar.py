"""The V2 runner's side of structured outputs, between one step and the next.

The grammar matchers (`samplers.structured.state.StructuredOutputsState`) advance on the host by the tokens a
step accepted, and a step's bitmasks walk the drafts its rows verify. With async scheduling those tokens and
drafts are still on the device when the next step starts, so the runner keeps, from one step to the next,
the output whose tokens the matchers have not consumed and (GPU) a host copy of the drafts just proposed.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from framework.batch.input_batch import InputBatch
from framework.batch.request_state import RequestState
from framework.runner.async_output import AsyncOutput
from samplers.states import SamplingStates


class GrammarHandoff:
    """What the grammar matchers read of the previous step: `pending` (its output number and `AsyncOutput`,
    until the matchers consume its tokens) and `drafts` (GPU: req_slots [R], drafts [R, k] pinned, copy event
    of the drafts proposed with it). Everything here is a no-op while no request is constrained."""

    def __init__(
        self, sampling_states: SamplingStates, request_state: RequestState, copy_stream: Optional[torch.cuda.Stream]
    ) -> None:
        self.sampling_states, self.request_state, self.copy_stream = sampling_states, request_state, copy_stream
        self.pending: Optional[tuple[int, AsyncOutput]] = None
        self.drafts: Optional[tuple[np.ndarray, torch.Tensor, torch.cuda.Event]] = None

    @property
    def active(self) -> bool:
        """Whether some request in a slot is constrained by a grammar now."""
        structured = self.sampling_states.structured
        return structured is not None and structured.active

    def advance_matchers(self) -> None:
        """Feed the last step's accepted tokens to the grammar matchers (nobody constrained: drop them). On a GPU
        this waits for that step's copy, which the device finished before the forward just queued: the forward
        keeps running."""
        pending, self.pending = self.pending, None
        if pending is None or not self.active:
            return
        seq, output = pending
        self.sampling_states.structured.advance(  # type: ignore[union-attr]
            seq, output.request_ids, output.sampled_token_ids(), self.request_state.req_id_to_slot
        )

    def output_started(self, seq: int, output: AsyncOutput) -> None:
        """Output number `seq` of the runner started its copy: the next step's matchers consume its tokens."""
        if self.active:
            self.pending = (seq, output)

    def fill_bitmask(self, batch: InputBatch, logits_row_starts: np.ndarray) -> None:
        """Start the masks of every constrained logits row, drafts included (each verified draft advances its
        row); the sampler's grammar stage waits for them. `logits_row_starts` [R]: first logits row per batch row."""
        drafts: list[list[int]] = [[] for _ in range(batch.num_rows)]
        if batch.num_logits > batch.num_rows:
            num_draft = batch.num_draft_host
            if self.drafts is not None:  # GPU: the host copy made when they were proposed
                slots, host, event = self.drafts
                if not event.query():  # copied right after they were proposed, before this step's forward
                    event.synchronize()
                by_slot = dict(zip(slots.tolist(), host.tolist()))
            else:  # CPU: read the slots' drafts in place
                by_slot = {}
            for row, slot in enumerate(batch.idx_mapping_host.tolist()):
                k = int(num_draft[row])
                if k:
                    d = by_slot.get(slot)
                    # Not in the copy (drafts of an earlier step, or a CPU run): read the slot, which on a GPU waits.
                    drafts[row] = d[:k] if d is not None else self.request_state.draft_tokens[slot, :k].tolist()
        self.sampling_states.structured.prepare(  # type: ignore[union-attr]
            batch.idx_mapping_host, logits_row_starts, drafts
        )

    def drafts_proposed(self, batch: InputBatch, num_propose: int) -> None:
        """The speculator just wrote `num_propose` drafts per row: on a GPU with constrained requests, start
        their D2H copy on the side stream (read by the next step's `fill_bitmask`); otherwise forget any copy."""
        if not (self.active and self.copy_stream is not None and num_propose):
            self.drafts = None
            return
        drafts = self.request_state.draft_tokens[batch.idx_mapping.long(), :num_propose]
        host = torch.empty(drafts.shape, dtype=drafts.dtype, pin_memory=True)
        main = torch.cuda.current_stream()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_stream(main)
            host.copy_(drafts, non_blocking=True)
            drafts.record_stream(self.copy_stream)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self.drafts = (batch.idx_mapping_host.copy(), host, event)
