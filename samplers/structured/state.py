"""Per-slot grammar matchers, and the step's token bitmask for every constrained logits row.

The matchers live on the host (the grammar library is CPU code). Each step the runner, after queueing the
forward, hands this state the tokens of earlier steps (`advance`) and starts this step's masks (`prepare`):
host threads fill them (`samplers.structured.fill`) while the main thread queues the logits and the sampler,
and `apply`, the sampler's first edit, waits for the last rows and sends the masks in one copy.

Drafts: a row verifying k drafts owns k+1 logits rows; row j is masked by the matcher after drafts 1..j.
The matcher is walked forward over the drafts the grammar accepts and rolled back, so it always holds the
accepted tokens only. A draft the grammar refuses is forbidden on the row before it, so the verifier rejects
it there; the rows after it are never read (left unmasked).

Thinking: a request with a `thinking_token_budget` is constrained in its answer only. Its slot is gated
(`samplers.structured.thinking_gate`) until its output holds the end-of-thinking ids (written by the model or
forced by the budget); until then its rows are not masked and its tokens do not reach the matcher.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import llguidance
import numpy as np
import torch

from framework.params.scheduler_output import NewRequestData
from samplers.structured.backend import GuidanceBackend
from samplers.structured.bitmask import apply_token_bitmask, bitmask_words
from samplers.structured.fill import BitmaskFiller, FillJob, FillTiming, default_fill_threads
from samplers.structured.thinking_gate import ThinkingGate

logger = logging.getLogger(__name__)


class StructuredOutputsState:
    """One llguidance matcher per constrained req_slot; `prepare` starts the step's compact bitmask, `apply`
    waits for it and masks the logits."""

    def __init__(
        self,
        max_num_reqs: int,
        max_logits_rows: int,
        vocab_size: int,
        backend: GuidanceBackend,
        device: torch.device,
        next_output: Callable[[], int],
        fill_threads: Optional[int] = None,
    ) -> None:
        self.backend = backend
        self.device = device
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self.matchers: list[Optional[llguidance.LLMatcher]] = [None] * max_num_reqs
        self.request_ids: list[Optional[str]] = [None] * max_num_reqs
        self.host_enabled = np.zeros(max_num_reqs, dtype=bool)
        # The matcher consumed end of sequence: the request ends, and rows still scheduled for it (async
        # scheduling runs one more step before its end is known) are not masked; their tokens are dropped.
        self.ended = np.zeros(max_num_reqs, dtype=bool)
        # Output sequence number from which a slot's matcher consumes tokens (its first step's output).
        self.first_output = np.zeros(max_num_reqs, dtype=np.int64)
        self.gate = ThinkingGate(max_num_reqs)  # slots whose grammar waits for the end of their thinking
        self.num_refused = 0  # sampled tokens a matcher refused: 0 unless a mask was not applied
        self.max_logits_rows = max_logits_rows
        self._next_output = next_output  # sequence number of the runner's next output
        # Allocated with the first constrained request: two pinned buffers used in turn (a step's copy may still
        # read one while the next step fills the other), and the fill threads.
        self._host_masks: list[torch.Tensor] = []
        self._host_rows: list[torch.Tensor] = []
        self._num_fills = 0
        self.fill_threads = default_fill_threads() if fill_threads is None else fill_threads
        self._filler: Optional[BitmaskFiller] = None
        self._step_rows = 0  # mask rows of the fill in flight (0: this step masks nothing)
        # Benchmarks set this to a list to collect each step's `FillTiming`.
        self.fill_timings: Optional[list[FillTiming]] = None

    # ---- per-slot verbs ---------------------------------------------------------------------------------
    def add_request(self, req_slot: int, new: NewRequestData) -> None:
        """A new or resumed request: it consumes tokens from the output of the step it first runs in on.

        A resumed request replays its earlier output (`prefill_token_ids[prompt_len:]`) into a fresh matcher.
        """
        params = new.sampling_params.structured_outputs
        self.host_enabled[req_slot] = params is not None
        self.ended[req_slot] = False
        self.matchers[req_slot] = None
        self.request_ids[req_slot] = new.request_id
        if params is None:
            return
        matcher = self.backend.new_matcher(params)
        self.gate.add_request(req_slot, new.sampling_params)
        replay = self.gate.answer_tokens(req_slot, list(new.prefill_token_ids[new.prompt_len :]))
        if replay and not _consume(matcher, replay):
            self.num_refused += 1
            logger.warning(
                "mrv2: request %r: its grammar refuses its own earlier output on resume: %r",
                new.request_id,
                matcher.get_error()[:200],
            )
        self.matchers[req_slot] = matcher
        self.first_output[req_slot] = self._next_output()
        if self._filler is None:
            pin = self.device.type == "cuda"
            shape = (self.max_logits_rows, self.num_words)
            self._host_masks = [torch.empty(shape, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
            self._host_rows = [torch.empty(shape[0], dtype=torch.int32, pin_memory=pin) for _ in range(2)]
            self._filler = BitmaskFiller(self.fill_threads)

    def set_fill_threads(self, num_threads: int) -> None:
        """Use `num_threads` fill threads from the next step on (benchmarks compare pool sizes on one engine)."""
        self._finish_fill()
        self.fill_threads = num_threads
        if self._filler is not None:
            self._filler = BitmaskFiller(num_threads)  # the old workers stop when it is collected

    def remove_request(self, req_slot: int) -> None:
        self.host_enabled[req_slot] = False
        self.matchers[req_slot] = None
        self.request_ids[req_slot] = None

    def apply_staged_writes(self) -> None:
        """Nothing on the device persists per slot: the masks are rebuilt every step."""

    def any_in(self, req_slots: np.ndarray) -> bool:
        return bool(self.host_enabled[req_slots].any())

    @property
    def active(self) -> bool:
        """Whether any slot is constrained (then every step's tokens must reach the matchers)."""
        return bool(self.host_enabled.any())

    # ---- the step ---------------------------------------------------------------------------------------
    def advance(
        self,
        output_seq: int,
        request_ids: Sequence[str],
        tokens: Sequence[Sequence[int]],
        req_id_to_slot: dict[str, int],
    ) -> None:
        """Feed one step's accepted tokens (per batch row of output `output_seq`) to the matchers."""
        self._finish_fill()  # a step that failed before its sampler ran: its matchers are still being read
        for request_id, row_tokens in zip(request_ids, tokens):
            slot = req_id_to_slot.get(request_id)
            if slot is None or not row_tokens or self.request_ids[slot] != request_id:
                continue  # left (finished, preempted) meanwhile, or a prefill chunk
            matcher = self.matchers[slot]
            if matcher is None or output_seq < self.first_output[slot] or self.ended[slot] or matcher.is_error():
                continue
            row_tokens = self.gate.answer_tokens(slot, list(row_tokens))
            eos = self.backend.eos_token_id
            if eos in row_tokens:  # the scheduler drops what follows end of sequence
                row_tokens = row_tokens[: row_tokens.index(eos) + 1]
                self.ended[slot] = True
            if not _consume(matcher, row_tokens):
                self.num_refused += 1
                logger.warning(
                    "mrv2: request %r: its grammar refused a sampled token: %r", request_id, matcher.get_error()[:200]
                )

    def prepare(
        self,
        req_slots: np.ndarray,  # [R] batch_row -> req_slot (host)
        logits_row_starts: np.ndarray,  # [R] first logits_row of each batch row (host)
        drafts: Sequence[Sequence[int]],  # per batch row: the draft tokens it verifies this step
    ) -> None:
        """Start filling the host bitmask of every constrained logits row (`apply` joins it).

        Only live constrained rows are visited; a step without any starts nothing."""
        self._finish_fill()
        buf = self._num_fills % 2
        host_rows = self._host_rows[buf]
        jobs: list[FillJob] = []
        target_rows: list[int] = []
        live = self.host_enabled[req_slots] & ~self.ended[req_slots] & ~self.gate.thinking[req_slots]
        for batch_row in np.flatnonzero(live).tolist():
            matcher = self.matchers[int(req_slots[batch_row])]
            if matcher is None or matcher.is_error():
                continue  # a matcher that already failed: its row is left unmasked
            row_drafts = list(drafts[batch_row])
            valid = matcher.validate_tokens(row_drafts) if row_drafts else 0
            start = int(logits_row_starts[batch_row])
            jobs.append(FillJob(matcher, len(target_rows), row_drafts[:valid]))
            target_rows.extend(range(start, start + valid + 1))
        self._step_rows = n = len(target_rows)
        if n == 0:
            return
        self._num_fills += 1
        host_rows[:n] = torch.from_numpy(np.asarray(target_rows, dtype=np.int32))
        assert self._filler is not None
        host_mask = self._host_masks[buf]  # rows contiguous: row r at data_ptr + r * 4 * num_words
        self._filler.start(jobs, host_mask.data_ptr(), 4 * self.num_words)

    def step_masks(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """This step's host masks, once filled: ([N, W] int32, [N] int32 logits_row of each); None if none."""
        self._finish_fill()
        n = self._step_rows
        if n == 0:
            return None
        buf = (self._num_fills - 1) % 2
        return self._host_masks[buf][:n], self._host_rows[buf][:n]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[L, V]: this step's masks applied (the sampler's first edit). Waits for the fill, then queues one
        copy of the masks (pinned host memory, no host sync) and the kernel."""
        step = self.step_masks()
        self._step_rows = 0
        if step is None:
            return logits
        mask, rows = (t.to(self.device, non_blocking=True) for t in step)
        return apply_token_bitmask(logits, mask, rows)

    def _finish_fill(self) -> None:
        if self._filler is not None and self._filler.in_flight:
            timing = self._filler.join()
            if self.fill_timings is not None and timing is not None:
                self.fill_timings.append(timing)


def _consume(matcher: llguidance.LLMatcher, tokens: list[int]) -> bool:
    """Advance over `tokens`. One at a time: llguidance's list call refuses end of sequence once the grammar has
    ended (its single-token call accepts it)."""
    return all(matcher.consume_token(t) for t in tokens)
