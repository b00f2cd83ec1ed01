"""The per-slot token counts the penalties read, rebuilt from the history and advanced on the device.

Four views of one set, kept in step by the same kernels (`samplers.penalties` has the semantics):

- `output_counts[s, t]`: occurrences of token t in the output of the request in slot s (int32 [S, V]);
- `prompt_mask[s, t]`: whether t occurs in its original prompt (bool [S, V]);
- `seen_bits[s]`: the set `seen = prompt or count > 0` as a bitmap (int32 [S, ceil(V / 32)], bit t % 32 of
  word t // 32);
- `seen_ids[s, :num_seen[s]]`: the same set as a list of token ids, each once, in no particular order
  (int32 [S, max_seen] and [S]).

The list is what makes the penalties cheap: the penalty kernel visits only listed tokens, so its cost
follows the history's distinct tokens (about a thousand for a long chat), not the vocabulary (150k). A token
joins the list when it is counted for the first time: the atomic or that sets its bit returns the old word
without the bit, and that lane, and only that one (atomics serialise, duplicates within a block included),
appends the token (an atomic add on `num_seen` gives its index). The bitmap therefore equals the list, and
the penalty kernel uses it to tell drafts that are not listed.

`max_seen` = min(V, max_model_len + K + 1) (`seen_capacity`): a slot never counts more tokens than its
history holds (plus one step's K + 1 sampled tokens), so never more distinct ones. Memory: 4 bytes per
entry, S x max_seen (256 slots at max_model_len 32k: 32 MiB, beside the 190 MiB of the [S, V] tables at
V = 151,936); allocated with those tables when the first penalised request arrives. Appends past
`max_seen` (only a slot that no penalised owner rebuilt, counting for ever) are dropped, and readers clamp
`num_seen` to `max_seen`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2
from samplers.triton_utils import use_triton


class PenaltyCounts(NamedTuple):
    """The [S, V] output-token counts and prompt-token presence of each req_slot, and their seen set."""

    output_counts: torch.Tensor  # [S, V] int32
    prompt_mask: torch.Tensor  # [S, V] bool
    seen_bits: torch.Tensor  # [S, ceil(V / 32)] int32: bit t % 32 of word t // 32 = seen[t]
    seen_ids: torch.Tensor  # [S, max_seen] int32: the seen tokens, first num_seen valid, each once, any order
    num_seen: torch.Tensor  # [S] int32 (may exceed max_seen on a slot nobody rebuilt: read it clamped)

    @staticmethod
    def zeros(max_num_reqs: int, vocab_size: int, max_seen: int, device: torch.device) -> PenaltyCounts:
        def z(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return PenaltyCounts(
            z(max_num_reqs, vocab_size),
            z(max_num_reqs, vocab_size, dtype=torch.bool),
            z(max_num_reqs, cdiv(vocab_size, 32)),
            z(max_num_reqs, max_seen),
            z(max_num_reqs),
        )


def seen_capacity(vocab_size: int, max_model_len: int, max_num_draft: int) -> int:
    """List entries per slot: a slot counts at most its history (plus one step's K + 1 sampled tokens)."""
    return max(1, min(vocab_size, max_model_len + max_num_draft + 1))


# ---- references --------------------------------------------------------------------------------------------


def seen_bits_reference(
    prompt_mask: torch.Tensor,  # [N, V] bool
    output_counts: torch.Tensor,  # [N, V] int32
) -> torch.Tensor:
    """[N, ceil(V / 32)] int32: bit t % 32 of word t // 32 is `prompt_mask[t] or output_counts[t] > 0`."""
    seen = prompt_mask | (output_counts > 0)
    rows, vocab = seen.shape
    words = cdiv(vocab, 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64, device=seen.device)
    padded[:, :vocab] = seen.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32, device=seen.device)).sum(-1)  # [N, W] < 2**32
    return (packed - ((packed >> 31) << 32)).int()  # the same 32 bits as a signed int32


def append_to_lists_reference(
    new: torch.Tensor,  # [N, V] bool: tokens to append to each row's list (none already listed)
    seen_ids: torch.Tensor,  # [N, max_seen] int32, rows updated
    num_seen: torch.Tensor,  # [N] int32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen_ids, num_seen) with each row's `new` tokens appended in increasing id order (past max_seen: dropped)."""
    rows, max_seen = seen_ids.shape
    at = num_seen.long().unsqueeze(1) + new.long().cumsum(1) - 1  # [N, V] index of each new token
    at = torch.where(new & (at < max_seen), at, max_seen)  # others go to a spare column
    padded = torch.cat([seen_ids, torch.zeros(rows, 1, dtype=seen_ids.dtype, device=seen_ids.device)], 1)
    tokens = torch.arange(new.shape[1], dtype=seen_ids.dtype, device=seen_ids.device).expand_as(at)
    padded.scatter_(1, at, tokens)
    return padded[:, :max_seen].contiguous(), (num_seen.long() + new.long().sum(1)).to(num_seen.dtype)


def seen_list_reference(
    prompt_mask: torch.Tensor,  # [N, V] bool
    output_counts: torch.Tensor,  # [N, V] int32
    max_seen: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, max_seen] int32, [N] int32): the seen tokens of each row in increasing id order, and their number."""
    rows = prompt_mask.shape[0]
    empty = torch.zeros(rows, max_seen, dtype=torch.int32, device=prompt_mask.device)
    return append_to_lists_reference(
        prompt_mask | (output_counts > 0), empty, torch.zeros(rows, dtype=torch.int32, device=prompt_mask.device)
    )


def init_token_counts_reference(
    all_token_ids: torch.Tensor,  # [S, max_model_len] int32
    prompt_len: torch.Tensor,  # [S] int32
    prefill_len: torch.Tensor,  # [S] int32
    req_slots: torch.Tensor,  # [N] int64: slots to rebuild
    counts: PenaltyCounts,  # rows of req_slots overwritten
) -> None:
    """Rebuild the rows of `req_slots` from their history: prompt presence, counts of the output part, the seen
    set (bitmap and list)."""
    rows = all_token_ids[req_slots].long()  # [N, M]
    cols = torch.arange(rows.shape[1], device=rows.device).unsqueeze(0)
    prompt = prompt_len.long()[req_slots].unsqueeze(1)
    prefill = prefill_len.long()[req_slots].unsqueeze(1)
    vocab = counts.output_counts.shape[1]
    in_prompt = torch.zeros(len(req_slots), vocab, dtype=torch.int32, device=rows.device)
    in_prompt.scatter_add_(1, rows, (cols < prompt).int())
    output = torch.zeros_like(in_prompt).scatter_add_(1, rows, ((cols >= prompt) & (cols < prefill)).int())
    counts.prompt_mask[req_slots] = in_prompt > 0
    counts.output_counts[req_slots] = output
    counts.seen_bits[req_slots] = seen_bits_reference(in_prompt > 0, output)
    seen_ids, num_seen = seen_list_reference(in_prompt > 0, output, counts.seen_ids.shape[1])
    counts.seen_ids[req_slots] = seen_ids
    counts.num_seen[req_slots] = num_seen


def update_token_counts_reference(
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot (distinct)
    sampled: torch.Tensor,  # [R, K+1] int64
    num_sampled: torch.Tensor,  # [R] int32
    counts: PenaltyCounts,  # updated in place
) -> None:
    """Add each row's first num_sampled tokens to its slot's counts; append the newly seen ones to its list."""
    rows = idx_mapping.long()
    seen_before = counts.prompt_mask[rows] | (counts.output_counts[rows] > 0)  # [R, V]
    cols = torch.arange(sampled.shape[1], device=sampled.device).unsqueeze(0)
    valid = (cols < num_sampled.long().unsqueeze(1)).int()  # [R, K+1]
    slots = rows.unsqueeze(1).expand_as(sampled)
    counts.output_counts.index_put_((slots, sampled.long()), valid, accumulate=True)
    output = counts.output_counts[rows]
    counts.seen_bits[rows] |= seen_bits_reference(torch.zeros_like(output, dtype=torch.bool), output)
    seen_ids, num_seen = append_to_lists_reference(
        (output > 0) & ~seen_before, counts.seen_ids[rows], counts.num_seen[rows]
    )
    counts.seen_ids[rows] = seen_ids
    counts.num_seen[rows] = num_seen


# ---- Triton ------------------------------------------------------------------------------------------------


@triton.jit
def _count_seen(tokens, mask, req_slot, bits_ptr, num_words, seen_ids_ptr, num_seen_ptr, max_seen):
    """Set the seen bits of a block of tokens; the lanes that set a bit first append their token to the list."""
    bit = (tokens % 32).to(tl.int32)
    old = tl.atomic_or(bits_ptr + req_slot * num_words + tokens // 32, 1 << bit, mask=mask)
    first = mask & (((old >> bit) & 1) == 0)  # exactly one lane per newly seen token, duplicates included
    at = tl.atomic_add(num_seen_ptr + req_slot + tl.zeros_like(bit), 1, mask=first)
    tl.store(seen_ids_ptr + req_slot * max_seen + at, tokens.to(tl.int32), mask=first & (at < max_seen))


@triton.jit
def _init_token_counts_kernel(
    tokens_ptr,
    tokens_stride,
    prompt_len_ptr,
    prefill_len_ptr,
    slots_ptr,
    counts_ptr,
    prompt_ptr,
    bits_ptr,
    num_words,
    seen_ids_ptr,
    num_seen_ptr,
    max_seen,
    vocab_size,
    BLOCK: tl.constexpr,
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
        _count_seen(tokens, mask, req_slot, bits_ptr, num_words, seen_ids_ptr, num_seen_ptr, max_seen)


def init_token_counts_triton(
    all_token_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    prefill_len: torch.Tensor,
    req_slots: torch.Tensor,
    counts: PenaltyCounts,
) -> None:
    """Same as `init_token_counts_reference` (the list in any order): the rows are cleared first, then one
    program per slot adds."""
    counts.output_counts[req_slots] = 0
    counts.prompt_mask[req_slots] = False
    counts.seen_bits[req_slots] = 0
    counts.num_seen[req_slots] = 0  # the old owner's entries past it are never read
    if len(req_slots):
        vocab_size = counts.output_counts.shape[1]
        _init_token_counts_kernel[(len(req_slots),)](
            all_token_ids,
            all_token_ids.stride(0),
            prompt_len,
            prefill_len,
            req_slots,
            counts.output_counts,
            counts.prompt_mask,
            counts.seen_bits,
            counts.seen_bits.shape[1],
            counts.seen_ids,
            counts.num_seen,
            counts.seen_ids.shape[1],
            vocab_size,
            BLOCK=256,
        )


@triton.jit
def _update_token_counts_kernel(
    idx_ptr,
    sampled_ptr,
    sampled_stride,
    num_sampled_ptr,
    counts_ptr,
    bits_ptr,
    num_words,
    seen_ids_ptr,
    num_seen_ptr,
    max_seen,
    vocab_size,
    BLOCK: tl.constexpr,
):
    batch_row = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(idx_ptr + batch_row).to(tl.int64)
    n = tl.load(num_sampled_ptr + batch_row)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    tokens = tl.load(sampled_ptr + batch_row * sampled_stride + cols, mask=mask, other=0).to(tl.int64)
    tl.atomic_add(counts_ptr + req_slot * vocab_size + tokens, tl.full([BLOCK], 1, tl.int32), mask=mask)
    _count_seen(tokens, mask, req_slot, bits_ptr, num_words, seen_ids_ptr, num_seen_ptr, max_seen)


def update_token_counts_triton(
    idx_mapping: torch.Tensor, sampled: torch.Tensor, num_sampled: torch.Tensor, counts: PenaltyCounts
) -> None:
    """Same as `update_token_counts_reference` (one program per batch row, atomics for repeated tokens)."""
    if sampled.shape[0]:
        sampled = sampled.contiguous()
        vocab_size = counts.output_counts.shape[1]
        _update_token_counts_kernel[(sampled.shape[0],)](
            idx_mapping,
            sampled,
            sampled.stride(0),
            num_sampled,
            counts.output_counts,
            counts.seen_bits,
            counts.seen_bits.shape[1],
            counts.seen_ids,
            counts.num_seen,
            counts.seen_ids.shape[1],
            vocab_size,
            BLOCK=max(16, next_power_of_2(sampled.shape[1])),
        )


# ---- dispatch ------------------------------------------------------------------------------------------------


def init_token_counts(
    all_token_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    prefill_len: torch.Tensor,
    req_slots: torch.Tensor,
    counts: PenaltyCounts,
) -> None:
    """Rebuild the counts and seen set of `req_slots` [N] int64 from the history (Triton on CUDA)."""
    fn = init_token_counts_triton if use_triton(counts.output_counts) else init_token_counts_reference
    fn(all_token_ids, prompt_len, prefill_len, req_slots, counts)


def update_token_counts(
    idx_mapping: torch.Tensor, sampled: torch.Tensor, num_sampled: torch.Tensor, counts: PenaltyCounts
) -> None:
    """Count this step's sampled tokens [R, K+1] (first num_sampled [R] of each row) into `counts`."""
    fn = update_token_counts_triton if use_triton(counts.output_counts) else update_token_counts_reference
    fn(idx_mapping, sampled, num_sampled, counts)
