"""bad_words: a word is a token-id sequence; its last token gets -inf when the output so far ends with the
rest of it (a one-token word is always excluded). Only output tokens count (vLLM semantics): a prefix must
start at or after `prompt_len`. Context positions past the history are the drafts being verified."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from framework.params.sampling_params import SamplingParams
from samplers.history import SlotLists, TokenHistory, context_tokens_reference
from samplers.triton_utils import small_block, use_triton


class BadWordsState:
    """Per req_slot: the words' tokens concatenated ([S, W] int32) and each word's end offset ([S, N] int32)."""

    def __init__(self, max_num_reqs: int, device: torch.device, history: TokenHistory) -> None:
        self.history = history
        self.tokens = SlotLists(max_num_reqs, torch.int32, device)
        self.word_ends = SlotLists(max_num_reqs, torch.int32, device)
        self.max_word_len = 1  # host: longest word seen, sizes the prefix comparison

    def add_request(self, req_slot: int, params: SamplingParams) -> None:
        words = params.bad_words_token_ids
        ends = np.cumsum([len(w) for w in words]).tolist() if words else []
        self.tokens.set(req_slot, [t for w in words for t in w])
        self.word_ends.set(req_slot, ends)
        self.max_word_len = max([self.max_word_len] + [len(w) for w in words])

    def remove_request(self, req_slot: int) -> None:
        self.word_ends.host_lens[req_slot] = 0

    def apply_staged_writes(self) -> None:
        self.tokens.apply_staged_writes()
        self.word_ends.apply_staged_writes()

    def any_in(self, req_slots: np.ndarray) -> bool:
        return self.word_ends.any_in(req_slots)

    def apply(
        self, logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, sample_positions: torch.Tensor
    ) -> torch.Tensor:
        return apply_bad_words(
            logits,
            expanded_idx_mapping,
            sample_positions,
            self.history,
            self.tokens.values,
            self.word_ends.values,
            self.word_ends.lens,
            self.max_word_len,
        )


def apply_bad_words_reference(
    logits: torch.Tensor,  # [L, V] float32
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    sample_positions: torch.Tensor,  # [L] int64
    history: TokenHistory,
    word_tokens: torch.Tensor,  # [S, W] int32: every word's tokens, concatenated
    word_ends: torch.Tensor,  # [S, N] int32: end offset of each word in word_tokens
    num_words: torch.Tensor,  # [S] int32
    max_word_len: int,
) -> torch.Tensor:
    """[L, V]: -inf at the last token of every word whose other tokens end the row's output."""
    device = logits.device
    slots = expanded_idx_mapping.long()  # [L]
    ends = word_ends.long()[slots]  # [L, N]
    starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1)
    lens = ends - starts  # [L, N]
    i = torch.arange(max_word_len, device=device).view(1, 1, -1)  # [1, 1, Lw]
    prefix_len = (lens - 1).unsqueeze(2)  # [L, N, 1]
    width = word_tokens.shape[1]
    word_tok = word_tokens.long()[slots.view(-1, 1, 1), (starts.unsqueeze(2) + i).clamp(max=width - 1)]
    ctx_pos = sample_positions.view(-1, 1, 1) - prefix_len + i  # [L, N, Lw]
    ctx_tok = context_tokens_reference(history, slots.view(-1, 1, 1).expand_as(ctx_pos), ctx_pos)
    in_output = ctx_pos >= history.prompt_len.long()[slots].view(-1, 1, 1)
    ok = (i >= prefix_len) | ((word_tok == ctx_tok) & in_output)
    hit = ok.all(dim=2) & (torch.arange(ends.shape[1], device=device) < num_words.long()[slots].unsqueeze(1))
    last = word_tokens.long()[slots.unsqueeze(1), (ends - 1).clamp(min=0)]  # [L, N]
    inf = torch.full((), float("inf"), device=device)
    return logits.scatter_reduce(1, last, torch.where(hit, -inf, inf), "amin")


@triton.jit
def _apply_bad_words_kernel(
    logits_ptr,
    logits_stride,
    idx_ptr,
    positions_ptr,
    all_tokens_ptr,
    all_tokens_stride,
    total_len_ptr,
    prompt_len_ptr,
    drafts_ptr,
    drafts_stride,
    num_drafts,
    words_ptr,
    words_stride,
    ends_ptr,
    ends_stride,
    num_words_ptr,
    BLOCK: tl.constexpr,
):
    logits_row = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(idx_ptr + logits_row).to(tl.int64)
    position = tl.load(positions_ptr + logits_row)
    total_len = tl.load(total_len_ptr + req_slot)
    prompt_len = tl.load(prompt_len_ptr + req_slot)
    n = tl.load(num_words_ptr + req_slot)
    i = tl.arange(0, BLOCK)
    start = tl.zeros([], dtype=tl.int32)
    for w in range(0, n):
        end = tl.load(ends_ptr + req_slot * ends_stride + w)
        prefix_len = end - start - 1
        in_prefix = i < prefix_len
        word_tok = tl.load(words_ptr + req_slot * words_stride + start + i, mask=in_prefix, other=0)
        ctx_pos = position - prefix_len + i
        from_history = in_prefix & (ctx_pos < total_len) & (ctx_pos >= 0)
        from_drafts = in_prefix & (ctx_pos >= total_len) & (ctx_pos - total_len < num_drafts)
        ctx = tl.load(all_tokens_ptr + req_slot * all_tokens_stride + ctx_pos, mask=from_history, other=-1)
        ctx = tl.where(
            from_drafts,
            tl.load(drafts_ptr + req_slot * drafts_stride + (ctx_pos - total_len), mask=from_drafts, other=-1),
            ctx,
        )
        mismatch = in_prefix & ((ctx != word_tok) | (ctx_pos < prompt_len))
        if tl.sum(mismatch.to(tl.int32), axis=0) == 0:
            last = tl.load(words_ptr + req_slot * words_stride + end - 1)
            tl.store(logits_ptr + logits_row * logits_stride + last, tl.full([], -float("inf"), tl.float32))
        start = end


def apply_bad_words_triton(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    sample_positions: torch.Tensor,
    history: TokenHistory,
    word_tokens: torch.Tensor,
    word_ends: torch.Tensor,
    num_words: torch.Tensor,
    max_word_len: int,
) -> torch.Tensor:
    """In place, same result as `apply_bad_words_reference` (one program per logits row)."""
    if logits.shape[0]:
        drafts = history.draft_tokens
        num_drafts = drafts.shape[1] if drafts.dim() == 2 else 0
        if num_drafts == 0:
            drafts = history.total_len  # never read (num_drafts = 0), but a real pointer
        _apply_bad_words_kernel[(logits.shape[0],)](
            logits,
            logits.stride(0),
            expanded_idx_mapping,
            sample_positions,
            history.all_token_ids,
            history.all_token_ids.stride(0),
            history.total_len,
            history.prompt_len,
            drafts,
            drafts.stride(0) if num_drafts else 0,
            num_drafts,
            word_tokens,
            word_tokens.stride(0),
            word_ends,
            word_ends.stride(0),
            num_words,
            BLOCK=small_block(max_word_len),
        )
    return logits


def apply_bad_words(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    sample_positions: torch.Tensor,
    history: TokenHistory,
    word_tokens: torch.Tensor,
    word_ends: torch.Tensor,
    num_words: torch.Tensor,
    max_word_len: int,
) -> torch.Tensor:
    """[L, V] masked logits (Triton on CUDA, writing in place; the reference elsewhere)."""
    fn = apply_bad_words_triton if use_triton(logits) else apply_bad_words_reference
    return fn(logits, expanded_idx_mapping, sample_positions, history, word_tokens, word_ends, num_words, max_word_len)
