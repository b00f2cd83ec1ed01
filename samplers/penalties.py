"""Repetition, frequency and presence penalties (vLLM semantics), with per-slot token counts on the device.

For a logits row of the request in slot s, with `count[t]` the occurrences of token t in its output so far
and `in_prompt[t]` whether t occurs in its original prompt (`prompt_len`, not the resumed prefill):

    seen   = in_prompt[t] or count[t] > 0
    l_t    = l_t / repetition if (seen and l_t > 0) else l_t * repetition if seen else l_t
    l_t   -= frequency * count[t] + presence * (count[t] > 0)

The counts live on the device ([S, V] int32 and [S, V] bool, allocated when the first request with a penalty
arrives). They are rebuilt from the token history when such a request takes a slot (so a reused or resumed
slot starts exact), and advanced from the sampled tokens every step without a host sync: by the accepted
drafts and the recovered or bonus token only, never by a rejected draft.

Under speculation a request verifying d drafts owns 1 + d logits rows; the row sampling position p sees the
drafts at positions `total_len .. p - 1` as if they had been accepted (`DraftContext`), so its `count` is
the slot's count plus the occurrences of t in `draft_tokens[s, :p - total_len]`: exactly what decoding
without speculation would have seen at p once those drafts were sampled. Rows that verify nothing
(p == total_len, or a prefill chunk with p <= total_len) see no draft.

Beside them, `seen_bits` ([S, ceil(V / 32)] int32) holds `seen` as a bitmap, kept in step by the same kernels
(atomic or). The Triton penalty kernel reads the bitmap (1/32 of the logits' bytes) and touches the logits,
counts and prompt mask only of seen tokens: a token nobody has seen keeps its logit exactly
(`l - 0 * frequency - 0 * presence == l`), so the result is the dense one, for a few percent of its traffic.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
import triton
import triton.language as tl

from framework.sampling_params import SamplingParams
from framework.staged_writes import StagedWrites
from samplers.history import TokenHistory
from samplers.triton_utils import use_triton, vocab_block


class DraftContext(NamedTuple):
    """The drafts before each verification row: row l of slot s counts `draft_tokens[s, :n]`,
    n = clamp(sample_positions[l] - total_len[s], 0, K) (the drafts at positions `total_len .. p - 1`)."""

    sample_positions: torch.Tensor  # [L] int64: position of the token each logits row samples
    total_len: torch.Tensor  # [S] int32: valid history entries per req_slot (this step's tokens not yet appended)
    draft_tokens: torch.Tensor  # [S, K] int32: drafts verified this step, per req_slot


class PenaltyTables(NamedTuple):
    """Everything the penalties read, for a kernel that applies them while it reads the logits anyway (the
    fused sampler's first pass, `samplers.fused_sampling`)."""

    repetition: torch.Tensor  # [S] float32, 1 = off
    frequency: torch.Tensor  # [S] float32, 0 = off
    presence: torch.Tensor  # [S] float32, 0 = off
    output_counts: torch.Tensor  # [S, V] int32
    prompt_mask: torch.Tensor  # [S, V] bool
    seen_bits: torch.Tensor  # [S, ceil(V / 32)] int32, consistent with the two above
    drafts: Optional[DraftContext]  # verification rows also count the drafts before them; None = no speculation


class PenaltyCounts:
    """The [S, V] output-token counts and prompt-token presence of each req_slot."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.output_counts = torch.zeros(max_num_reqs, vocab_size, dtype=torch.int32, device=device)  # [S, V]
        self.prompt_mask = torch.zeros(max_num_reqs, vocab_size, dtype=torch.bool, device=device)  # [S, V]
        self.seen_bits = torch.zeros(max_num_reqs, triton.cdiv(vocab_size, 32), dtype=torch.int32,
                                     device=device)  # [S, ceil(V / 32)]: bit t % 32 of word t // 32 = seen[t]


class PenaltiesState:
    """repetition / frequency / presence penalty per req_slot, and the token counts they read."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device, history: TokenHistory) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.history = history
        self.repetition = torch.ones(max_num_reqs, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(max_num_reqs, dtype=torch.float32, device=device)
        self.presence = torch.zeros(max_num_reqs, dtype=torch.float32, device=device)
        self.host_active = np.zeros(max_num_reqs, dtype=bool)
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
            if self.counts is None:
                self.counts = PenaltyCounts(self.max_num_reqs, self.vocab_size, self.device)
            self._rebuild_slots.append(req_slot)

    def remove_request(self, req_slot: int) -> None:
        """Nothing to clear: a new owner with a penalty rebuilds the slot's counts, one without never reads them."""
        self.host_active[req_slot] = False

    def apply_staged_writes(self) -> None:
        """Write parameters; rebuild the counts of new penalised slots (the history is already on the device)."""
        for staged in self._staged:
            staged.apply()
        if self._rebuild_slots and self.counts is not None:
            slots = torch.tensor(self._rebuild_slots, dtype=torch.int64).to(self.device, non_blocking=True)
            init_token_counts(self.history.all_token_ids, self.history.prompt_len, self.history.prefill_len, slots,
                              self.counts.output_counts, self.counts.prompt_mask, self.counts.seen_bits)
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
        assert self.counts is not None
        drafts = None
        if self.history.draft_tokens.shape[1]:  # speculation configured: K fixed for the run (one kernel variant)
            drafts = DraftContext(sample_positions, self.history.total_len, self.history.draft_tokens)
        return apply_penalties(logits, expanded_idx_mapping, self.repetition, self.frequency, self.presence,
                               self.counts.output_counts, self.counts.prompt_mask, self.counts.seen_bits, drafts)

    def tables(self, sample_positions: torch.Tensor) -> PenaltyTables:
        """What `apply` reads, for the fused sampler to apply the penalties itself (same result)."""
        assert self.counts is not None
        drafts = None
        if self.history.draft_tokens.shape[1]:
            drafts = DraftContext(sample_positions, self.history.total_len, self.history.draft_tokens)
        c = self.counts
        return PenaltyTables(self.repetition, self.frequency, self.presence, c.output_counts, c.prompt_mask,
                             c.seen_bits, drafts)

    def record_sampled(
        self,
        idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
        sampled: torch.Tensor,  # [R, K+1] int64: tokens of each row, the first num_sampled valid
        num_sampled: torch.Tensor,  # [R] int32
    ) -> None:
        """Count this step's sampled tokens (on the device; every slot, only penalised ones are ever read)."""
        if self.counts is not None:
            update_token_counts(idx_mapping, sampled, num_sampled, self.counts.output_counts, self.counts.seen_bits)


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


def seen_bits_reference(
    prompt_mask: torch.Tensor,  # [N, V] bool
    output_counts: torch.Tensor,  # [N, V] int32
) -> torch.Tensor:
    """[N, ceil(V / 32)] int32: bit t % 32 of word t // 32 is `prompt_mask[t] or output_counts[t] > 0`."""
    seen = prompt_mask | (output_counts > 0)
    rows, vocab = seen.shape
    words = triton.cdiv(vocab, 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64, device=seen.device)
    padded[:, :vocab] = seen.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32, device=seen.device)).sum(-1)  # [N, W] < 2**32
    return (packed - ((packed >> 31) << 32)).int()  # the same 32 bits as a signed int32


def init_token_counts_reference(
    all_token_ids: torch.Tensor,  # [S, max_model_len] int32
    prompt_len: torch.Tensor,  # [S] int32
    prefill_len: torch.Tensor,  # [S] int32
    req_slots: torch.Tensor,  # [N] int64: slots to rebuild
    output_counts: torch.Tensor,  # [S, V] int32, rows of req_slots overwritten
    prompt_mask: torch.Tensor,  # [S, V] bool, rows of req_slots overwritten
    seen_bits: Optional[torch.Tensor] = None,  # [S, W] int32, rows of req_slots overwritten
) -> None:
    """Rebuild the rows of `req_slots` from their history: prompt presence, and counts of the output part."""
    rows = all_token_ids[req_slots].long()  # [N, M]
    cols = torch.arange(rows.shape[1], device=rows.device).unsqueeze(0)
    prompt = prompt_len.long()[req_slots].unsqueeze(1)
    prefill = prefill_len.long()[req_slots].unsqueeze(1)
    vocab = output_counts.shape[1]
    in_prompt = torch.zeros(len(req_slots), vocab, dtype=torch.int32, device=rows.device)
    in_prompt.scatter_add_(1, rows, (cols < prompt).int())
    counts = torch.zeros_like(in_prompt).scatter_add_(1, rows, ((cols >= prompt) & (cols < prefill)).int())
    prompt_mask[req_slots] = in_prompt > 0
    output_counts[req_slots] = counts
    if seen_bits is not None:
        seen_bits[req_slots] = seen_bits_reference(in_prompt > 0, counts)


def update_token_counts_reference(
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    sampled: torch.Tensor,  # [R, K+1] int64
    num_sampled: torch.Tensor,  # [R] int32
    output_counts: torch.Tensor,  # [S, V] int32, updated in place
    seen_bits: Optional[torch.Tensor] = None,  # [S, W] int32, updated in place
) -> None:
    """Add each row's first num_sampled tokens to its slot's counts (and set their seen bits)."""
    cols = torch.arange(sampled.shape[1], device=sampled.device).unsqueeze(0)
    valid = (cols < num_sampled.long().unsqueeze(1)).int()  # [R, K+1]
    slots = idx_mapping.long().unsqueeze(1).expand_as(sampled)
    output_counts.index_put_((slots, sampled.long()), valid, accumulate=True)
    if seen_bits is not None:
        rows = idx_mapping.long()
        counts = output_counts[rows]
        seen_bits[rows] |= seen_bits_reference(torch.zeros_like(counts, dtype=torch.bool), counts)


# ---- Triton ------------------------------------------------------------------------------------------------


@triton.jit
def _slot_penalties(rep_ptr, freq_ptr, pres_ptr, req_slot):
    """(repetition, frequency, presence, any of them on) of a req_slot."""
    rep = tl.load(rep_ptr + req_slot)
    freq = tl.load(freq_ptr + req_slot)
    pres = tl.load(pres_ptr + req_slot)
    return rep, freq, pres, (rep != 1.0) | (freq != 0.0) | (pres != 0.0)


@triton.jit
def _drafts_before(logits_row, req_slot, positions_ptr, total_len_ptr, max_drafts):
    """How many of the slot's drafts precede this logits row (positions total_len .. p - 1)."""
    before = tl.load(positions_ptr + logits_row) - tl.load(total_len_ptr + req_slot).to(tl.int64)
    return tl.minimum(tl.maximum(before, 0), max_drafts)


@triton.jit
def _penalty_lanes(offs, mask, req_slot, before, counts_ptr, prompt_ptr, bits_ptr, num_words, drafts_ptr,
                   drafts_stride, vocab_size, SPARSE: tl.constexpr, HAS_DRAFTS: tl.constexpr):
    """(lanes whose logit changes, their counts as float32, their prompt presence) of a block of tokens.

    SPARSE: only seen tokens (and drafts) change; the other lanes' loads are masked off (no traffic)."""
    extra = tl.zeros(offs.shape, dtype=tl.int32)  # occurrences among the drafts before this row
    if HAS_DRAFTS:
        for i in range(0, before):
            draft = tl.load(drafts_ptr + req_slot * drafts_stride + i)
            extra += (offs == draft).to(tl.int32)
    if SPARSE:
        word = tl.load(bits_ptr + req_slot * num_words + offs // 32, mask=mask, other=0)
        mask = mask & ((((word >> (offs % 32)) & 1) != 0) | (extra > 0))
    counts = (tl.load(counts_ptr + req_slot * vocab_size + offs, mask=mask, other=0) + extra).to(tl.float32)
    in_prompt = tl.load(prompt_ptr + req_slot * vocab_size + offs, mask=mask, other=0) != 0
    return mask, counts, in_prompt


@triton.jit
def _penalise(x, counts, in_prompt, rep, freq, pres):
    in_output = counts > 0
    penalised = tl.where(x > 0, x / rep, x * rep)
    x = tl.where(in_prompt | in_output, penalised, x)
    return x - freq * counts - pres * in_output.to(tl.float32)


@triton.jit
def _apply_penalties_kernel(
    logits_ptr, logits_stride, idx_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, bits_ptr, num_words,
    positions_ptr, total_len_ptr, drafts_ptr, drafts_stride, max_drafts,
    vocab_size, SPARSE: tl.constexpr, HAS_DRAFTS: tl.constexpr, BLOCK: tl.constexpr,
):
    logits_row = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(idx_ptr + logits_row).to(tl.int64)
    rep, freq, pres, active = _slot_penalties(rep_ptr, freq_ptr, pres_ptr, req_slot)
    if active:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        before = 0
        if HAS_DRAFTS:  # a verification row: drafts at positions total_len .. p - 1 count as output
            before = _drafts_before(logits_row, req_slot, positions_ptr, total_len_ptr, max_drafts)
        mask, counts, in_prompt = _penalty_lanes(offs, offs < vocab_size, req_slot, before, counts_ptr, prompt_ptr,
                                                 bits_ptr, num_words, drafts_ptr, drafts_stride, vocab_size,
                                                 SPARSE, HAS_DRAFTS)
        x = tl.load(logits_ptr + logits_row * logits_stride + offs, mask=mask)
        x = _penalise(x, counts, in_prompt, rep, freq, pres)
        tl.store(logits_ptr + logits_row * logits_stride + offs, x, mask=mask)


def apply_penalties_triton(
    logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
    presence: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
    seen_bits: Optional[torch.Tensor] = None, drafts: Optional[DraftContext] = None,
) -> torch.Tensor:
    """In place, same result as `apply_penalties_reference` (grid: logits rows x vocab blocks).

    With `seen_bits` (which must match the counts and prompt mask), only seen tokens and the drafts before a
    row are read and written. With `drafts`, each program compares its block with the (at most K) drafts
    before its row: K x BLOCK comparisons, no extra traffic over the logits.
    """
    num_rows, vocab_size = logits.shape
    if num_rows:
        block = vocab_block(vocab_size)
        bits = seen_bits if seen_bits is not None else output_counts  # any pointer: unread when not SPARSE
        has_drafts = drafts is not None and drafts.draft_tokens.shape[1] > 0
        if has_drafts:
            assert drafts is not None
            positions, total_len, draft_tokens = drafts.sample_positions, drafts.total_len, drafts.draft_tokens
        else:  # any pointers: unread when not HAS_DRAFTS
            positions, total_len, draft_tokens = expanded_idx_mapping, expanded_idx_mapping, output_counts
        _apply_penalties_kernel[(num_rows, triton.cdiv(vocab_size, block))](
            logits, logits.stride(0), expanded_idx_mapping, repetition, frequency, presence, output_counts,
            prompt_mask, bits, triton.cdiv(vocab_size, 32), positions, total_len, draft_tokens,
            draft_tokens.stride(0), draft_tokens.shape[1] if has_drafts else 0, vocab_size,
            SPARSE=seen_bits is not None, HAS_DRAFTS=has_drafts, BLOCK=block,
        )
    return logits


@triton.jit
def _init_token_counts_kernel(
    tokens_ptr, tokens_stride, prompt_len_ptr, prefill_len_ptr, slots_ptr, counts_ptr, prompt_ptr, bits_ptr,
    num_words, vocab_size, HAS_BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    req_slot = tl.load(slots_ptr + tl.program_id(0))
    prompt_len = tl.load(prompt_len_ptr + req_slot)
    prefill_len = tl.load(prefill_len_ptr + req_slot)
    for start in range(0, prefill_len, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < prefill_len
        tokens = tl.load(tokens_ptr + req_slot * tokens_stride + offs, mask=mask, other=0).to(tl.int64)
        dest = req_slot * vocab_size + tokens
        tl.store(prompt_ptr + dest, tl.full([BLOCK], 1, tl.int1), mask=mask & (offs < prompt_len))
        tl.atomic_add(counts_ptr + dest, tl.full([BLOCK], 1, tl.int32), mask=mask & (offs >= prompt_len))
        if HAS_BITS:
            tl.atomic_or(bits_ptr + req_slot * num_words + tokens // 32, (1 << (tokens % 32)).to(tl.int32), mask=mask)


def init_token_counts_triton(
    all_token_ids: torch.Tensor, prompt_len: torch.Tensor, prefill_len: torch.Tensor, req_slots: torch.Tensor,
    output_counts: torch.Tensor, prompt_mask: torch.Tensor, seen_bits: Optional[torch.Tensor] = None,
) -> None:
    """Same as `init_token_counts_reference`: the rows are cleared first, then one program per slot adds."""
    output_counts[req_slots] = 0
    prompt_mask[req_slots] = False
    if seen_bits is not None:
        seen_bits[req_slots] = 0
    if len(req_slots):
        vocab_size = output_counts.shape[1]
        _init_token_counts_kernel[(len(req_slots),)](
            all_token_ids, all_token_ids.stride(0), prompt_len, prefill_len, req_slots, output_counts, prompt_mask,
            seen_bits if seen_bits is not None else output_counts, triton.cdiv(vocab_size, 32), vocab_size,
            HAS_BITS=seen_bits is not None, BLOCK=256,
        )


@triton.jit
def _update_token_counts_kernel(idx_ptr, sampled_ptr, sampled_stride, num_sampled_ptr, counts_ptr, bits_ptr,
                                num_words, vocab_size, HAS_BITS: tl.constexpr, BLOCK: tl.constexpr):
    batch_row = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(idx_ptr + batch_row).to(tl.int64)
    n = tl.load(num_sampled_ptr + batch_row)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    tokens = tl.load(sampled_ptr + batch_row * sampled_stride + cols, mask=mask, other=0)
    tl.atomic_add(counts_ptr + req_slot * vocab_size + tokens, tl.full([BLOCK], 1, tl.int32), mask=mask)
    if HAS_BITS:
        tl.atomic_or(bits_ptr + req_slot * num_words + tokens // 32, (1 << (tokens % 32)).to(tl.int32), mask=mask)


def update_token_counts_triton(
    idx_mapping: torch.Tensor, sampled: torch.Tensor, num_sampled: torch.Tensor, output_counts: torch.Tensor,
    seen_bits: Optional[torch.Tensor] = None,
) -> None:
    """Same as `update_token_counts_reference` (one program per batch row, atomics for repeated tokens)."""
    if sampled.shape[0]:
        sampled = sampled.contiguous()
        vocab_size = output_counts.shape[1]
        _update_token_counts_kernel[(sampled.shape[0],)](
            idx_mapping, sampled, sampled.stride(0), num_sampled, output_counts,
            seen_bits if seen_bits is not None else output_counts, triton.cdiv(vocab_size, 32), vocab_size,
            HAS_BITS=seen_bits is not None, BLOCK=max(16, triton.next_power_of_2(sampled.shape[1])),
        )


# ---- dispatch ------------------------------------------------------------------------------------------------


def apply_penalties(
    logits: torch.Tensor,  # [L, V] float32 (written in place on CUDA)
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    repetition: torch.Tensor,  # [S] float32
    frequency: torch.Tensor,  # [S] float32
    presence: torch.Tensor,  # [S] float32
    output_counts: torch.Tensor,  # [S, V] int32
    prompt_mask: torch.Tensor,  # [S, V] bool
    seen_bits: Optional[torch.Tensor] = None,  # [S, ceil(V / 32)] int32, consistent with the two above
    drafts: Optional[DraftContext] = None,  # verification rows also count the drafts before them
) -> torch.Tensor:
    """[L, V] penalised logits (Triton on CUDA, reading only seen tokens given `seen_bits`; else the reference)."""
    if use_triton(logits):
        return apply_penalties_triton(logits, expanded_idx_mapping, repetition, frequency, presence, output_counts,
                                      prompt_mask, seen_bits, drafts)
    return apply_penalties_reference(logits, expanded_idx_mapping, repetition, frequency, presence, output_counts,
                                     prompt_mask, drafts)


def init_token_counts(all_token_ids: torch.Tensor, prompt_len: torch.Tensor, prefill_len: torch.Tensor,
                      req_slots: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                      seen_bits: Optional[torch.Tensor] = None) -> None:
    """Rebuild the counts (and seen bits) of `req_slots` [N] int64 from the history (Triton on CUDA)."""
    fn = init_token_counts_triton if use_triton(output_counts) else init_token_counts_reference
    fn(all_token_ids, prompt_len, prefill_len, req_slots, output_counts, prompt_mask, seen_bits)


def update_token_counts(idx_mapping: torch.Tensor, sampled: torch.Tensor, num_sampled: torch.Tensor,
                        output_counts: torch.Tensor, seen_bits: Optional[torch.Tensor] = None) -> None:
    """Count this step's sampled tokens [R, K+1] (first num_sampled [R] of each row) into `output_counts`."""
    fn = update_token_counts_triton if use_triton(output_counts) else update_token_counts_reference
    fn(idx_mapping, sampled, num_sampled, output_counts, seen_bits)
