"""Repetition, frequency and presence penalties (vLLM semantics), with per-slot token counts on the device.

For a logits row of the request in slot s, with `count[t]` the occurrences of token t in its output so far
and `in_prompt[t]` whether t occurs in its original prompt (`prompt_len`, not the resumed prefill):

    seen   = in_prompt[t] or count[t] > 0
    l_t    = l_t / repetition if (seen and l_t > 0) else l_t * repetition if seen else l_t
    l_t   -= frequency * count[t] + presence * (count[t] > 0)

The counts live on the device (`samplers.penalty_counts.PenaltyCounts`: [S, V] counts and prompt mask, the
seen set as a bitmap and as a compact list of token ids; allocated when the first request with a penalty
arrives). They are rebuilt from the token history when such a request takes a slot (so a reused or resumed
slot starts exact), and advanced from the sampled tokens every step without a host sync: by the accepted
drafts and the recovered or bonus token only, never by a rejected draft.

Under speculation a request verifying d drafts owns 1 + d logits rows; the row sampling position p sees the
drafts at positions `total_len .. p - 1` as if they had been accepted (`DraftContext`), so its `count` is
the slot's count plus the occurrences of t in `draft_tokens[s, :p - total_len]`: exactly what decoding
without speculation would have seen at p once those drafts were sampled. Rows that verify nothing
(p == total_len, or a prefill chunk with p <= total_len) see no draft.

The Triton kernel touches only the tokens a row can change: a token nobody has seen keeps its logit exactly
(`l - 0 * frequency - 0 * presence == l`). Its programs walk the slot's list of seen tokens (a few hundred
to a few thousand ids, against a vocabulary of 150k) and gather each one's logit, count and prompt flag; on a
verification row they add the drafts before it to the listed tokens' counts, and penalise the drafts that
are not listed (bitmap test) once each, at their first occurrence. The result is the dense one, and the
kernel costs microseconds where a pass over the logits costs a full read of them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
import triton
import triton.language as tl

from framework.batch.staged_writes import StagedWrites
from framework.layers.kernels.launch_math import cdiv
from framework.params.sampling_params import SamplingParams
from samplers.history import TokenHistory
from samplers.penalty_counts import PenaltyCounts, init_token_counts, seen_capacity, update_token_counts
from samplers.triton_utils import small_block, use_triton


class DraftContext(NamedTuple):
    """The drafts before each verification row: row l of slot s counts `draft_tokens[s, :n]`,
    n = clamp(sample_positions[l] - total_len[s], 0, K) (the drafts at positions `total_len .. p - 1`)."""

    sample_positions: torch.Tensor  # [L] int64: position of the token each logits row samples
    total_len: torch.Tensor  # [S] int32: valid history entries per req_slot (this step's tokens not yet appended)
    draft_tokens: torch.Tensor  # [S, K] int32: drafts verified this step, per req_slot


class PenaltyTables(NamedTuple):
    """Everything the penalty kernel reads."""

    repetition: torch.Tensor  # [S] float32, 1 = off
    frequency: torch.Tensor  # [S] float32, 0 = off
    presence: torch.Tensor  # [S] float32, 0 = off
    counts: PenaltyCounts  # counts, prompt mask and their seen set (bitmap and list), consistent
    drafts: Optional[DraftContext]  # verification rows also count the drafts before them; None = no speculation


class PenaltiesState:
    """repetition / frequency / presence penalty per req_slot, and the token counts they read.

    One row more than there are slots: row `max_num_reqs` (penalties off) serves the padding rows of full-step
    graphs (`framework.runner.graphs.step_graphs`), which also allocate the counts before capture
    (`allocate_counts`)."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device, history: TokenHistory) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.history = history
        rows = max_num_reqs + 1  # + the dummy slot of full-step graphs
        self.repetition = torch.ones(rows, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(rows, dtype=torch.float32, device=device)
        self.presence = torch.zeros(rows, dtype=torch.float32, device=device)
        self.host_active = np.zeros(rows, dtype=bool)
        self._staged = [StagedWrites(t) for t in (self.repetition, self.frequency, self.presence)]
        self.counts: Optional[PenaltyCounts] = None
        self._rebuild_slots: list[int] = []

    def add_request(self, req_slot: int, params: SamplingParams) -> None:
        values = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
        for staged, value in zip(self._staged, values):
            staged.stage(req_slot, value)
        active = values != (1.0, 0.0, 0.0)
        self.host_active[req_slot] = active
        if active:
            self.allocate_counts()
            self._rebuild_slots.append(req_slot)

    def allocate_counts(self) -> PenaltyCounts:
        """The [S+1, V] counts (allocated once: when the first penalised request arrives, or before full-step
        graphs capture the kernels that read them)."""
        if self.counts is None:
            max_seen = seen_capacity(
                self.vocab_size, self.history.all_token_ids.shape[1], self.history.draft_tokens.shape[1]
            )
            self.counts = PenaltyCounts.zeros(self.max_num_reqs + 1, self.vocab_size, max_seen, self.device)
        return self.counts

    def remove_request(self, req_slot: int) -> None:
        """Nothing to clear: a new owner with a penalty rebuilds the slot's counts, one without never reads them."""
        self.host_active[req_slot] = False

    def apply_staged_writes(self) -> None:
        """Write parameters; rebuild the counts of new penalised slots (the history is already on the device)."""
        for staged in self._staged:
            staged.apply()
        if self._rebuild_slots and self.counts is not None:
            # Once per slot (a slot re-added before this call would otherwise be counted by two programs).
            unique = sorted(set(self._rebuild_slots))
            slots = torch.tensor(unique, dtype=torch.int64).to(self.device, non_blocking=True)
            init_token_counts(
                self.history.all_token_ids, self.history.prompt_len, self.history.prefill_len, slots, self.counts
            )
        self._rebuild_slots.clear()

    def any_in(self, req_slots: np.ndarray) -> bool:
        return bool(self.host_active[req_slots].any())

    def apply(
        self,
        logits: torch.Tensor,  # [L, V] float32
        expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
        sample_positions: torch.Tensor,  # [L] int64: position of the token each logits row samples
    ) -> torch.Tensor:
        """[L, V] penalised logits; verification rows also count the drafts before them (module docstring)."""
        return apply_penalties(logits, expanded_idx_mapping, self.tables(sample_positions))

    def tables(self, sample_positions: torch.Tensor) -> PenaltyTables:
        """What `apply` reads (`sample_positions` [L] int64)."""
        assert self.counts is not None
        drafts = None
        if self.history.draft_tokens.shape[1]:  # speculation configured: K fixed for the run (one kernel variant)
            drafts = DraftContext(sample_positions, self.history.total_len, self.history.draft_tokens)
        return PenaltyTables(self.repetition, self.frequency, self.presence, self.counts, drafts)

    def record_sampled(
        self,
        idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
        sampled: torch.Tensor,  # [R, K+1] int64: tokens of each row, the first num_sampled valid
        num_sampled: torch.Tensor,  # [R] int32
    ) -> None:
        """Count this step's sampled tokens (on the device; every slot, only penalised ones are ever read)."""
        if self.counts is not None:
            update_token_counts(idx_mapping, sampled, num_sampled, self.counts)


# ---- references --------------------------------------------------------------------------------------------


def apply_penalties_reference(
    logits: torch.Tensor,  # [L, V] float32
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    repetition: torch.Tensor,  # [S] float32, 1 = off
    frequency: torch.Tensor,  # [S] float32, 0 = off
    presence: torch.Tensor,  # [S] float32, 0 = off
    output_counts: torch.Tensor,  # [S, V] int32
    prompt_mask: torch.Tensor,  # [S, V] bool
    drafts: Optional[DraftContext] = None,  # the drafts before each verification row; None = no speculation
) -> torch.Tensor:
    """[L, V] penalised logits (each row's counts plus the drafts before it, given `drafts`)."""
    slots = expanded_idx_mapping.long()
    counts = output_counts[slots].float()  # [L, V]
    if drafts is not None and drafts.draft_tokens.shape[1]:
        counts = counts + draft_counts_reference(slots, drafts, logits.shape[1])
    in_output = counts > 0
    seen = prompt_mask[slots] | in_output
    rep = repetition[slots].unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - frequency[slots].unsqueeze(1) * counts - presence[slots].unsqueeze(1) * in_output.float()


def draft_counts_reference(
    slots: torch.Tensor,  # [L] int64: req_slot of each logits row
    drafts: DraftContext,
    vocab_size: int,
) -> torch.Tensor:
    """[L, V] float32: occurrences of each token among the drafts before each logits row (ids outside the
    vocabulary count nowhere)."""
    num_drafts = drafts.draft_tokens.shape[1]
    before = (drafts.sample_positions.long() - drafts.total_len.long()[slots]).clamp(0, num_drafts)  # [L]
    tokens = drafts.draft_tokens.long()[slots]  # [L, K]
    in_context = torch.arange(num_drafts, device=slots.device) < before.unsqueeze(1)  # [L, K]
    valid = in_context & (tokens >= 0) & (tokens < vocab_size)
    out = torch.zeros(len(slots), vocab_size, dtype=torch.float32, device=slots.device)
    return out.scatter_add_(1, tokens.clamp(0, vocab_size - 1), valid.float())


# ---- Triton ------------------------------------------------------------------------------------------------

LIST_BLOCK = 256  # listed tokens per program and iteration
TARGET_PROGRAMS = 2048  # a row's list is split over about TARGET_PROGRAMS / L programs (at most its capacity)


@triton.jit
def _slot_penalties(rep_ptr, freq_ptr, pres_ptr, req_slot):
    """(repetition, frequency, presence, any of them on) of a req_slot."""
    rep = tl.load(rep_ptr + req_slot)
    freq = tl.load(freq_ptr + req_slot)
    pres = tl.load(pres_ptr + req_slot)
    return rep, freq, pres, (rep != 1.0) | (freq != 0.0) | (pres != 0.0)


@triton.jit
def _penalise(x, counts, in_prompt, rep, freq, pres):
    in_output = counts > 0
    penalised = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)  # IEEE division, as torch (few tokens: cheap)
    x = tl.where(in_prompt | in_output, penalised, x)
    return x - freq * counts - pres * in_output.to(tl.float32)


@triton.jit
def _apply_penalties_kernel(
    logits_ptr,
    logits_stride,
    idx_ptr,
    rep_ptr,
    freq_ptr,
    pres_ptr,
    counts_ptr,
    prompt_ptr,
    bits_ptr,
    num_words,
    seen_ids_ptr,
    num_seen_ptr,
    max_seen,
    positions_ptr,
    total_len_ptr,
    drafts_ptr,
    drafts_stride,
    max_drafts,
    vocab_size,
    HAS_DRAFTS: tl.constexpr,
    BLOCK: tl.constexpr,
    DRAFT_BLOCK: tl.constexpr,
):
    logits_row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    num_parts = tl.num_programs(1)
    req_slot = tl.load(idx_ptr + logits_row).to(tl.int64)
    rep, freq, pres, active = _slot_penalties(rep_ptr, freq_ptr, pres_ptr, req_slot)
    if active:
        row_ptr = logits_ptr + logits_row * logits_stride
        drafts_row = drafts_ptr + req_slot * drafts_stride
        before = 0  # drafts at positions total_len .. p - 1 count as output (a verification row)
        if HAS_DRAFTS:
            before = tl.load(positions_ptr + logits_row) - tl.load(total_len_ptr + req_slot).to(tl.int64)
            before = tl.minimum(tl.maximum(before, 0), max_drafts)
        # 1. The listed (seen) tokens, this program's share of them: count, prompt flag and logit gathered.
        num_listed = tl.minimum(tl.load(num_seen_ptr + req_slot), max_seen)
        for start in range(part * BLOCK, num_listed, num_parts * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < num_listed
            tokens = tl.load(seen_ids_ptr + req_slot * max_seen + offs, mask=mask, other=0).to(tl.int64)
            counts = tl.load(counts_ptr + req_slot * vocab_size + tokens, mask=mask, other=0)
            if HAS_DRAFTS:
                for i in range(0, before):
                    counts += (tokens == tl.load(drafts_row + i)).to(tl.int32)
            in_prompt = tl.load(prompt_ptr + req_slot * vocab_size + tokens, mask=mask, other=0) != 0
            x = tl.load(row_ptr + tokens, mask=mask)
            tl.store(row_ptr + tokens, _penalise(x, counts.to(tl.float32), in_prompt, rep, freq, pres), mask=mask)
        # 2. Drafts before the row that are not listed (not in the bitmap), counted over the drafts alone (unseen:
        # in no prompt, count 0). Disjoint from 1. Each distinct one is written once, by its first occurrence
        # (repeats would store the same value: one store per token keeps the writes simple to reason about).
        if HAS_DRAFTS:
            if part == 0:
                lanes = tl.arange(0, DRAFT_BLOCK)
                valid = lanes < before
                tokens = tl.load(drafts_row + lanes, mask=valid, other=-1).to(tl.int64)
                valid = valid & (tokens >= 0) & (tokens < vocab_size)
                bit = (tokens % 32).to(tl.int32)
                word = tl.load(bits_ptr + req_slot * num_words + tokens // 32, mask=valid, other=0)
                first = valid & (((word >> bit) & 1) == 0)
                counts = tl.zeros([DRAFT_BLOCK], dtype=tl.int32)
                for i in range(0, before):
                    same = tokens == tl.load(drafts_row + i)
                    counts += same.to(tl.int32)
                    first = first & ~(same & (i < lanes))
                x = tl.load(row_ptr + tokens, mask=first)
                x = _penalise(x, counts.to(tl.float32), lanes < 0, rep, freq, pres)
                tl.store(row_ptr + tokens, x, mask=first)


def apply_penalties_triton(
    logits: torch.Tensor,  # [L, V] float32, penalised in place
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    tables: PenaltyTables,
) -> torch.Tensor:
    """In place, same result as `apply_penalties_reference` (grid: logits rows x parts of their lists).

    Only listed tokens are read and written (and, on verification rows, drafts not yet listed), so the cost
    follows the distinct tokens of the histories, not the vocabulary. The grid depends on host sizes only
    (rows, list capacity): no host sync; each program loops over its share of the device-side list length,
    and programs past it do nothing.
    """
    num_rows, vocab_size = logits.shape
    if num_rows:
        assert logits.stride(1) == 1, "the penalty kernel indexes logits rows by token id"
        c, d = tables.counts, tables.drafts
        assert all(t.is_contiguous() for t in c), "the penalty tables are indexed as dense rows"
        max_seen = c.seen_ids.shape[1]
        parts = max(1, min(cdiv(max_seen, LIST_BLOCK), cdiv(TARGET_PROGRAMS, num_rows)))
        has_drafts = d is not None and d.draft_tokens.shape[1] > 0
        if has_drafts:
            assert d is not None
            positions, total_len, draft_tokens = d.sample_positions, d.total_len, d.draft_tokens
        else:  # any pointers: unread when not HAS_DRAFTS
            positions, total_len, draft_tokens = expanded_idx_mapping, expanded_idx_mapping, c.seen_ids
        _apply_penalties_kernel[(num_rows, parts)](
            logits,
            logits.stride(0),
            expanded_idx_mapping,
            tables.repetition,
            tables.frequency,
            tables.presence,
            c.output_counts,
            c.prompt_mask,
            c.seen_bits,
            c.seen_bits.shape[1],
            c.seen_ids,
            c.num_seen,
            max_seen,
            positions,
            total_len,
            draft_tokens,
            draft_tokens.stride(0),
            draft_tokens.shape[1] if has_drafts else 0,
            vocab_size,
            HAS_DRAFTS=has_drafts,
            BLOCK=LIST_BLOCK,
            DRAFT_BLOCK=small_block(draft_tokens.shape[1] if has_drafts else 1),
        )
    return logits


# ---- dispatch ------------------------------------------------------------------------------------------------


def apply_penalties(
    logits: torch.Tensor,  # [L, V] float32 (written in place on CUDA)
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    tables: PenaltyTables,
) -> torch.Tensor:
    """[L, V] penalised logits (Triton on CUDA, touching listed tokens only; else the reference)."""
    if use_triton(logits):
        return apply_penalties_triton(logits, expanded_idx_mapping, tables)
    c = tables.counts
    return apply_penalties_reference(
        logits,
        expanded_idx_mapping,
        tables.repetition,
        tables.frequency,
        tables.presence,
        c.output_counts,
        c.prompt_mask,
        tables.drafts,
    )
