"""Full-step CUDA graphs: a whole pure-decode step (inputs, attention metadata, forward, logits, sampling,
post-update) captured as one graph per (padded batch size, sampling variant) — `runner.full_step_cuda_graphs`.

What one replay runs, on the device, for B padded rows of one token each (the graph's static buffers): input
preparation through `idx_mapping`, the block-table gather and KV slots, the forward, the LM head, the sampler
(every parameter and table read per slot through `expanded_idx_mapping`), `num_sampled`, and the post-update
(history, penalty counts). The host's work per step: one H2D copy of the padded `idx_mapping` (from pinned host
buffers used in turn, `framework.batch.host_staging.HostRing`), one replay, the usual async D2H copy of the tokens (and
logprobs). docs/architecture.md ("The whole decode step as one graph").

Padding rows map to the dummy slot (row `max_num_reqs` of `RequestState`, `BlockTables` and the sampling
parameters, which no request takes): the graph resets its lengths first, so a padding row is a 1-token decode
at position 0 whose KV store is skipped (KV slot -1) and whose post-update touches only that row.

Graph-safe steps (`full_step_blocker` names the first reason a step is not; such a step runs today's path,
the forward-only graph with the eager sampler): every row 1 token and no drafts, at most the largest capture
size, and no row whose sampling needs host work or state the graph does not hold: prompt logprobs, structured
outputs (host-filled bitmasks), bad_words, custom logits processors, pooling rows, recurrent-state snapshots,
processed logprobs (`sampler.logprobs_mode`), and steps whose per-slot tables were reallocated since capture.
Not captured at all (the runner logs why): speculative decoding (the verification shapes keep their forward
graphs), tensor / pipeline parallelism, and model states without `full_step_graphs` (states with per-step
hooks: Mamba, Whisper, plugins).

The sampler runs with fixed stage flags, one graph per variant: `PLAIN_STAGES` (temperature / greedy),
`CUTOFF_STAGES` (also top-k, top-p, min-p) when any row uses a cutoff, `PENALTY_STAGES` (cutoffs and penalties)
when any row has a penalty, and one general variant (`general_stages`: every stage above plus allowed_token_ids,
min_tokens, logit_bias, and raw logprobs with the top `sampler.max_logprobs`) when any row asks for one of those.
The sampler's results do not depend on those flags (they only skip work no row needs: a row without a cutoff,
a penalty, a bias... passes those stages unchanged, its slot's table row being a no-op), so the tokens equal the
eager path's; the copy-out keeps the first `1 + k` logprob columns (k: the batch's largest `logprobs`, the eager
sampler's shape). One general variant, not one per feature combination: 4 graphs per size, not 2^4 more. The
captured kernels read their tables at fixed addresses, so they are made before capture: the penalty counts
(`PenaltiesState.allocate_counts`), the allowed-tokens mask, room for `LOGIT_BIAS_WIDTH` bias entries and
`STOP_IDS_WIDTH` stop ids per slot. A longer list later widens its table (a new tensor the graph does not read):
from then on steps that need the general variant fall back ("sampling tables reallocated").
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from framework.batch.block_tables import BlockTables
from framework.batch.host_staging import HostRing
from framework.batch.request_state import RequestState
from framework.layers.attention import AttentionMetadata
from framework.layers.kernels.input_prep import compute_num_sampled, post_update, prepare_inputs
from framework.params.scheduler_output import SchedulerOutput
from framework.runner.graphs.cuda_graphs import CudaGraphCapturer, GraphCapturer, Replayable
from samplers.logprobs import LogprobsTensors
from samplers.sampler import Sampler
from samplers.states import SamplingStages, SamplingStates

logger = logging.getLogger(__name__)

PLAIN_STAGES = SamplingStages(any_random=True, any_top_k=False, any_top_p=False, any_min_p=False)
CUTOFF_STAGES = SamplingStages(any_random=True, any_top_k=True, any_top_p=True, any_min_p=True)
PENALTY_STAGES = SamplingStages(any_random=True, any_top_k=True, any_top_p=True, any_min_p=True, any_penalties=True)
VARIANTS = (PLAIN_STAGES, CUTOFF_STAGES, PENALTY_STAGES)  # + general_stages(k): four per size
LOGIT_BIAS_WIDTH = 300  # entries per slot reserved before capture (the OpenAI API's limit per request)
STOP_IDS_WIDTH = 64  # min_tokens stop ids per slot (eos + stop_token_ids) reserved before capture
THINK_END_WIDTH = 16  # end-of-thinking ids per slot (thinking_token_budget) reserved before capture

# (input_ids [B], positions [B], kv_caches, metadata) -> hidden [B, hidden]; hidden -> logits [B, vocab] in the
# model dtype (an intermediate of the captured step, not a static buffer: each variant's sampler casts, or not).
StepForward = Callable[[torch.Tensor, torch.Tensor, list, AttentionMetadata], torch.Tensor]
ComputeLogits = Callable[[torch.Tensor], torch.Tensor]


class RowNeeds(NamedTuple):
    """What this step's rows ask of the sampler and the runner, from host mirrors (no device sync)."""

    stages: SamplingStages
    prompt_logprobs: bool  # some row still scores its prompt
    pooling: bool  # some row is an embedding request


def general_stages(num_logprobs: int) -> SamplingStages:
    """The general variant: every stage the graph holds, raw logprobs with the top `num_logprobs` (-1: none)."""
    return SamplingStages(
        any_random=True,
        any_top_k=True,
        any_top_p=True,
        any_min_p=True,
        any_allowed_tokens=True,
        any_min_tokens=True,
        any_thinking_budget=True,
        any_logit_bias=True,
        any_penalties=True,
        num_logprobs=num_logprobs,
    )


def needs_general(stages: SamplingStages) -> bool:
    """Whether a batch with `stages` takes the general variant (some row's stage only that variant holds)."""
    return (
        stages.num_logprobs >= 0
        or stages.any_allowed_tokens
        or stages.any_min_tokens
        or stages.any_thinking_budget
        or stages.any_logit_bias
    )


def full_step_blocker(
    output: SchedulerOutput, max_rows: int, row_needs: Callable[[], RowNeeds], logprobs_inside: bool = True
) -> Optional[str]:
    """None when this step can run as one full-step graph of at most `max_rows` rows; otherwise why not (the
    runner counts the reasons). `row_needs` is asked only for a pure-decode step that fits; `logprobs_inside`:
    the general variant computes logprobs (raw logprobs mode)."""
    if max(output.num_scheduled_tokens) != 1 or any(output.num_draft_tokens):
        return "not pure decode"
    if len(output.num_scheduled_tokens) > max_rows:
        return "more rows than the largest graph"
    if output.state_snapshots:
        return "state snapshots"
    needs = row_needs()
    s = needs.stages
    host_work = (
        ("processed logprobs", s.num_logprobs >= 0 and not logprobs_inside),
        ("prompt logprobs", needs.prompt_logprobs),
        ("structured outputs", s.any_structured),
        ("bad_words", s.any_bad_words),
        ("logits processors", bool(s.processors)),
        ("pooling", needs.pooling),
    )
    return next((reason for reason, present in host_work if present), None)


def graph_stages(stages: SamplingStages, general: SamplingStages) -> SamplingStages:
    """The fixed stage flags of the graph variant that serves a graph-safe batch with `stages` (`general`: the
    general variant's)."""
    if needs_general(stages):
        return general
    if stages.any_penalties:
        return PENALTY_STAGES
    return CUTOFF_STAGES if stages.any_top_k or stages.any_top_p or stages.any_min_p else PLAIN_STAGES


def skip_padding_stores(kv_slots: torch.Tensor, idx_mapping: torch.Tensor, dummy_slot: int) -> torch.Tensor:
    """[B] int64 KV slots with -1 (no store) on padding rows: the dummy slot's block-table row is nobody's
    blocks, so its stores must not land (one token per row: batch_row = token)."""
    return kv_slots.masked_fill_(idx_mapping == dummy_slot, -1)


class _Captured(NamedTuple):
    """The static outputs of one captured step ([B] rows each; the first R are this step's)."""

    tokens: torch.Tensor  # [B, 1] int64
    num_sampled: torch.Tensor  # [B] int32
    errors: torch.Tensor  # [B] int32
    logprobs: Optional[LogprobsTensors]  # [B, 1 + max_logprobs]: the general variant only


class FullStepResult(NamedTuple):
    """One replayed step, for `sample_tokens`: its rows and the sampled tokens (all that the copy-out needs)."""

    request_ids: list[str]  # batch_row -> request id
    tokens: torch.Tensor  # [R, 1] int64
    num_sampled: torch.Tensor  # [R] int32
    errors: torch.Tensor  # [R] int32: samplers.sampler ROW_* codes
    logprobs: Optional[LogprobsTensors] = None  # [R, 1+k] (k: the batch's largest `logprobs`) when some row asked


class FullStepGraphs:
    """Static buffers sized for the largest capture size and one captured step per (size, stage variant)."""

    def __init__(
        self,
        forward: StepForward,
        compute_logits: ComputeLogits,
        sampler: Sampler,
        request_state: RequestState,
        block_tables: BlockTables,
        kv_caches: list[torch.Tensor],
        capture_sizes: list[int],
        max_model_len: int,
        device: torch.device,
        capturer: Optional[GraphCapturer] = None,
        max_logprobs: int = 20,
    ) -> None:
        self.forward, self.compute_logits, self.sampler = forward, compute_logits, sampler
        self.request_state, self.block_tables, self.kv_caches = request_state, block_tables, kv_caches
        self.sizes = sorted(capture_sizes)
        self.max_model_len = max_model_len
        self.dummy_slot = request_state.graph_dummy_slot
        self._capturer: GraphCapturer = capturer if capturer is not None else CudaGraphCapturer()
        n = self.sizes[-1]
        # Per step: only idx_mapping changes. The rest is the same for every 1-token decode batch.
        self.idx_mapping = torch.full((n,), self.dummy_slot, dtype=torch.int32, device=device)  # [B] req_slot
        self._host_idx = HostRing(n, device)  # pinned on a GPU; a copy in flight is never overwritten
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [B+1]: also cu_num_logits
        self.ones = torch.ones(n, dtype=torch.int32, device=device)  # [B] query_lens
        self.zeros = torch.zeros(n, dtype=torch.int32, device=device)  # [B] num_draft = num_accepted
        self.graphs: dict[tuple[int, SamplingStages], Replayable] = {}
        self.logprobs_inside = sampler.logprobs_mode == "raw_logprobs"  # processed ones: the blocker says so
        self.general = general_stages(max_logprobs if self.logprobs_inside else -1)
        self.variants = VARIANTS + (self.general,)
        # The widenable tables the general variant read at capture: held (a freed table's address could come back
        # for a later, wider one) and compared by identity.
        self._tables: tuple[Optional[torch.Tensor], ...] = ()

    def _step(self, size: int, stages: SamplingStages) -> Callable[[], _Captured]:
        rs, bt, dummy = self.request_state, self.block_tables, self.dummy_slot
        idx = self.idx_mapping[:size]
        qsl = self.query_start_loc[: size + 1]
        query_lens, zeros = self.ones[:size], self.zeros[:size]

        def step() -> _Captured:
            rs.num_computed[dummy : dummy + 1].zero_()  # padding rows: a 1-token decode at position 0, every step
            rs.total_len[dummy : dummy + 1].zero_()
            prepared, token_rows = prepare_inputs(
                idx,
                qsl,
                qsl,
                size,
                size,
                rs.all_token_ids,
                rs.prefill_len,
                rs.num_computed,
                rs.last_sampled,
                rs.draft_tokens,
                1,
            )
            table = bt.gather(idx)  # [B, max_blocks]
            kv_slots = skip_padding_stores(bt.kv_slot_mapping(token_rows, prepared.positions, table), idx, dummy)
            meta = AttentionMetadata(  # max_seq_len fixed: kernels size grids from it, stop at each row's seq_len
                num_tokens=size,
                num_rows=size,
                query_start_loc=qsl,
                seq_lens=prepared.seq_lens,
                block_tables=table,
                kv_slot_mapping=kv_slots,
                block_size=bt.block_size,
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
            hidden = self.forward(prepared.input_ids, prepared.positions, self.kv_caches, meta)
            sampled = self.sampler(
                self.compute_logits(hidden), prepared.expanded_idx_mapping, prepared.sample_positions, stages
            )
            tokens = sampled.sampled_token_ids.view(size, 1)
            num_sampled, num_rejected = compute_num_sampled(idx, prepared.seq_lens, rs.prefill_len, zeros, zeros)
            post_update(
                idx,
                query_lens,
                tokens,
                num_sampled,
                num_rejected,
                rs.all_token_ids,
                rs.total_len,
                rs.num_computed,
                rs.last_sampled,
            )
            if stages.any_penalties:  # the counts advance (other variants: no row of the batch ever reads them)
                self.sampler.states.record_sampled(idx, tokens, num_sampled)
            assert sampled.errors is not None
            return _Captured(tokens, num_sampled, sampled.errors, sampled.logprobs)

        return step

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, variant), largest first so that smaller graphs reuse its memory pool. Every row
        maps to the dummy slot meanwhile, so the warm-up runs write nothing of a real slot."""
        self.idx_mapping.fill_(self.dummy_slot)
        states = self.sampler.states
        states.penalties.allocate_counts()  # the penalty and general variants' kernels read them at fixed addresses
        states.allowed_tokens.allocate_mask()  # the general variant's tables, likewise
        states.logit_bias.reserve(LOGIT_BIAS_WIDTH)
        states.min_tokens.reserve(STOP_IDS_WIDTH)
        states.thinking_budget.reserve(THINK_END_WIDTH)
        self._tables = _widenable_tables(states)
        for stages in self.variants:
            for size in reversed(self.sizes):
                self.graphs[(size, stages)] = self._capturer.capture(self._step(size, stages))
        self._capturer.finish()
        logger.info("captured full-step CUDA graphs for decode batch sizes %s", self.sizes)

    def blocker(self, output: SchedulerOutput, row_needs: Callable[[], RowNeeds]) -> Optional[str]:
        """`full_step_blocker` for these graphs, and "sampling tables reallocated" for a step that needs the
        general variant after a table it reads was widened (a new tensor the graph does not read)."""
        reason = full_step_blocker(output, self.sizes[-1], row_needs, self.logprobs_inside)
        if (
            reason is None
            and needs_general(row_needs().stages)
            and any(now is not then for now, then in zip(_widenable_tables(self.sampler.states), self._tables))
        ):
            return "sampling tables reallocated"
        return reason

    def padded_size(self, num_rows: int) -> Optional[int]:
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self,
        output: SchedulerOutput,
        req_slots: np.ndarray,
        stages: SamplingStages,
        copy_stream: Optional[torch.cuda.Stream],
    ) -> FullStepResult:
        """Copy this step's idx_mapping (`req_slots` [R], padding rows -> dummy slot) and replay. The caller
        checked `full_step_blocker` and did the host bookkeeping of `build_input_batch`.

        The results are the graph's static outputs, which the next replay overwrites: on a GPU that replay
        first waits for `copy_stream` (where the previous step's results are copied to the host); without one
        (CPU) they are cloned here, as the host reads them later."""
        r = len(req_slots)
        size = self.padded_size(r)
        assert size is not None, f"{r} rows: no full-step graph holds them (full_step_blocker says why)"
        index, host, host_np = self._host_idx.take()
        host_np[:r] = req_slots
        host_np[r:size] = self.dummy_slot
        self.idx_mapping[:size].copy_(host[:size], non_blocking=True)
        self._host_idx.sent(index)
        if copy_stream is not None:
            torch.cuda.current_stream().wait_stream(copy_stream)
        out = self.graphs[(size, graph_stages(stages, self.general))].replay()
        tokens, num_sampled, errors = out.tokens[:r], out.num_sampled[:r], out.errors[:r]
        logprobs = None
        if stages.num_logprobs >= 0:  # the eager sampler's shape: the batch's largest k columns of top-k
            assert out.logprobs is not None
            cols = 1 + stages.num_logprobs
            logprobs = LogprobsTensors(
                out.logprobs.token_ids[:r, :cols], out.logprobs.logprobs[:r, :cols], out.logprobs.ranks[:r]
            )
        if copy_stream is None:
            tokens, num_sampled, errors = tokens.clone(), num_sampled.clone(), errors.clone()
            if logprobs is not None:
                logprobs = LogprobsTensors(*(t.clone() for t in logprobs))
        return FullStepResult(list(output.scheduled_request_ids), tokens, num_sampled, errors, logprobs)


def _widenable_tables(states: SamplingStates) -> tuple[Optional[torch.Tensor], ...]:
    """The per-slot tables that a longer list reallocates (`SlotLists` widens by a new tensor), and the mask."""
    return (
        states.logit_bias.tokens.values,
        states.logit_bias.values.values,
        states.min_tokens.stop_ids.values,
        states.thinking_budget.end_ids.values,
        states.allowed_tokens.mask,
    )
