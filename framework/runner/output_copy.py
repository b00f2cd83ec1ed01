"""The V2 runner's device-to-host copy of each step's results: pinned landing buffers used in turn, one side stream.

`OutputCopies.start` (an eager step) and `start_full_step` (a replayed full step) each return the step's
`AsyncOutput`, whose `get()` waits for the copy; `num_outputs` counts the outputs started so far (the grammar
hand-off and the structured-output state key their work by it).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from framework.batch.input_batch import InputBatch
from framework.layers.kernels.input_prep import token_batch_rows
from framework.runner.async_output import AsyncOutput
from framework.runner.graphs.step_graphs import FullStepResult
from framework.runner.pooling import PooledRows
from samplers.prompt_logprobs import PromptLogprobsPiece
from samplers.sampler import SamplerOutput

# Landing buffers used in turn: at most two outputs are in flight, a third is being filled.
NUM_HOST_BUFFERS = 3


class OutputCopies:
    """Starts the asynchronous copies of sampled tokens (and what comes with them) to the host."""

    def __init__(self, max_reqs: int, num_speculative_tokens: int, device: torch.device) -> None:
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Flat, so that the [R, k+1] landing view of any step is contiguous (`landing_view`). None on the CPU.
        self._host_buffers = (
            [
                (
                    torch.empty(max_reqs * (num_speculative_tokens + 1), dtype=torch.int64, pin_memory=True),
                    torch.empty(max_reqs, dtype=torch.int32, pin_memory=True),
                )
                for _ in range(NUM_HOST_BUFFERS)
            ]
            if self.copy_stream is not None
            else []
        )
        self.num_outputs = 0

    def start(
        self,
        batch: InputBatch,
        tokens: torch.Tensor,  # [R, K'+1] int64: the sampled (and accepted draft) tokens of each batch row
        num_sampled: torch.Tensor,  # [R] int32: how many of them count
        sampled: SamplerOutput,
        prompt_logprobs: Optional[PromptLogprobsPiece],
        pooled: Optional[PooledRows],
    ) -> AsyncOutput:
        """The copy of an eager step's results, started on the side stream."""
        return AsyncOutput(
            batch.request_ids,
            tokens,
            num_sampled,
            self.copy_stream,
            self._next_host_buffers(),
            logprobs=sampled.logprobs,
            logits_row_starts=logits_row_starts(batch),
            errors=row_errors(batch, sampled.errors),
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )

    def start_full_step(self, step: FullStepResult) -> AsyncOutput:
        """The copy of a replayed full step's tokens and logprobs (its rows have no grammars or pooling)."""
        return AsyncOutput(
            step.request_ids,
            step.tokens,
            step.num_sampled,
            self.copy_stream,
            self._next_host_buffers(),
            logprobs=step.logprobs,
            errors=step.errors,
        )

    def _next_host_buffers(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The pinned landing buffers of the next output (in turn; None on the CPU); counts the output."""
        buffers = self._host_buffers[self.num_outputs % len(self._host_buffers)] if self._host_buffers else None
        self.num_outputs += 1
        return buffers


def logits_row_starts(batch: InputBatch) -> np.ndarray:
    """[R] first logits_row of each batch row (host prefix sum of 1 + drafts)."""
    return np.cumsum(1 + batch.num_draft_host) - (1 + batch.num_draft_host)


def row_errors(batch: InputBatch, errors: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[R] int32: the worst error code of each batch row's logits rows ([L] `errors` per logits_row)."""
    if errors is None or batch.num_logits == batch.num_rows:
        return errors
    rows = token_batch_rows(batch.cu_num_logits, batch.num_logits)
    return torch.zeros(batch.num_rows, dtype=errors.dtype, device=errors.device).scatter_reduce_(
        0, rows, errors, "amax"
    )
